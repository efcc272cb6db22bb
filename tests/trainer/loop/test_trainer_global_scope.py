"""algo.scope and trainer.packing in the config. Global-scope Clip-Cov/KL-Cov in the policy update, 1 process against
2 gloo ranks: tests/trainer/e2e/test_trainer_global_scope_e2e.py."""

from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]


def test_config_scope_and_packing():
    from fastcov.trainer.config import ConfigError, load_config

    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    assert cfg.algo.scope == "global" and cfg.trainer.packing is True
    assert load_config(ROOT / "configs" / "tiny.yaml", ["algo.scope=microbatch"]).algo.scope == "microbatch"
    with pytest.raises(ConfigError, match="algo.scope"):
        load_config(ROOT / "configs" / "tiny.yaml", ["algo.scope=batch"])
    with pytest.raises(ConfigError, match="trainer.packing"):
        load_config(ROOT / "configs" / "tiny.yaml", ["trainer.packing=sometimes"])
