"""Asynchronous rollouts (rollout.async, docs/async.md): the config's one-line refusals, the key's name, the async
study's arms. The runs themselves (one_step's schedule and resume, stream's drops, an engine that dies, LoRA, the
algorithms off-policy): tests/trainer/e2e/test_trainer_async_e2e.py."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from _fixtures import ROOT, TINY, tiny  # noqa: E402

from fastcov.trainer.config import ConfigError, load_config  # noqa: E402

# ------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("over,key", [
    (["rollout.async=one_step", "rollout.seeding=batch"], "rollout.seeding"),
    (["rollout.async=one_step", "rollout.sync_every=2"], "rollout.sync_every"),
    (["rollout.async=stream", "rollout.max_staleness=0"], "rollout.max_staleness"),
    (["rollout.async=stream", "rollout.stale=correct", "algo.rollout_correction.enabled=false"], "rollout.stale"),
    (["rollout.async=one_step", "rollout.engine=vllm"], "rollout.vllm_mode"),
    (["rollout.async=one_step", "rollout.engine_restarts=1", "trainer.zero_stage=3"], "rollout.engine_restarts"),
    (["rollout.async=sometimes"], "rollout.async"),
    (["rollout.queue_size=-1"], "rollout.queue_size"),
    (["algo.rollout_correction.bypass=true", "algo.rollout_correction.enabled=false"],
     "algo.rollout_correction.bypass"),
])
def test_bad_async_config_is_one_line_naming_the_key(tmp_path, over, key):
    with pytest.raises(ConfigError) as err:
        tiny(tmp_path, "x", *over)
    assert str(err.value).startswith(key + ":") or f"'{key}'" in str(err.value), str(err.value)


def test_the_async_key_is_written_as_async():
    cfg = load_config(TINY, ["rollout.async=stream"])
    assert cfg.rollout.async_mode == "stream" and cfg.to_dict()["rollout"]["async"] == "stream"
    assert "async_mode" not in cfg.to_dict()["rollout"]
    with pytest.raises(ConfigError, match="unknown config key 'rollout.async_mode'"):
        load_config(TINY, ["rollout.async_mode=stream"])


def test_the_async_study_loads_every_arm_with_its_staleness():
    from fastcov.trainer.experiments.study import load_study

    study = load_study(ROOT / "configs" / "studies" / "async.yaml")
    for arm, over in study["arms"].items():
        cfg = load_config(ROOT / "configs" / "demo.yaml", [*study["common"], *over])
        stale = 0 if cfg.rollout.async_mode == "off" else cfg.rollout.max_staleness
        assert stale == (4 if "_s4" in arm else 1 if "_s1" in arm else 0), arm
        assert cfg.rollout.async_mode in ("off", "one_step"), arm  # exact staleness: fixed schedules only
        corrected = cfg.algo.rollout_correction.enabled is not False
        assert corrected == ("nocorr" not in arm), arm
        assert cfg.algo.rollout_correction.bypass == ("bypass" in arm), arm
