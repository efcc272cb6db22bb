"""The verl examples of the README and docs/ run in verl's own environment (make test-verl): the ```python blocks
that import verl, and the ``key=value`` overrides of every ``python -m verl.trainer.main_ppo`` command shown, composed
into verl 0.9.1's own ``ppo_trainer`` config (hydra), select a fastcov loss verl's registry holds."""

import pathlib
import re
import sys

import pytest

verl = pytest.importorskip("verl", reason="verl is installed only in .venv-verl (make test-verl)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "project"))
from test_readme import BLOCKS, PAGES, run_block, uses_verl  # noqa: E402

VERL_BLOCKS = [(name, block) for name, block in BLOCKS if uses_verl(block)]


def test_the_docs_have_verl_examples():
    assert VERL_BLOCKS


@pytest.mark.parametrize("name, block", VERL_BLOCKS, ids=[name for name, _ in VERL_BLOCKS])
def test_verl_block_runs(name, block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_block(name, block)


def _commands():
    """(page, [key=value, ...]) of each ``python -m verl.trainer.main_ppo ...`` command (backslash continuations)."""
    found = []
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if "python -m verl.trainer.main_ppo" in line:
                found.append((str(page.relative_to(ROOT)), re.findall(r"(\S+=\S+)", line)))
    return found


COMMANDS = _commands()


@pytest.mark.parametrize("page, overrides", COMMANDS, ids=[page for page, _ in COMMANDS])
def test_verl_command_overrides_select_a_fastcov_loss(page, overrides):
    import os

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    assert overrides, page
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        # a micro-batch size is what any real run sets besides these (verl refuses an actor config without one)
        cfg = compose(config_name="ppo_trainer",
                      overrides=[*overrides, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    for override in overrides:  # each landed where the page says (a typo'd key would have failed compose)
        key, value = override.split("=", 1)
        got = OmegaConf.select(cfg, key)
        assert str(got) == value or float(got) == float(value), (override, got)
    mode = actor.policy_loss.loss_mode
    assert mode.startswith("fastcov_") and get_policy_loss_fn(mode).__name__ == mode
