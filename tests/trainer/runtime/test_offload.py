"""ZeRO-Offload (trainer.offload_optimizer): the optimizer states live on the host and DeepSpeed's CPU
Adam steps them; one training step gives the weights plain AdamW gives."""

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from _fixtures import TINY

from fastcov.trainer import train as train_mod
from fastcov.trainer.config import ConfigError, load_config
from fastcov.trainer.rewards import RewardFn
from fastcov.trainer.runtime.policy import ds_config


def _cfg(tmp_path, name, *over):
    return load_config(TINY, [f"trainer.run_dir={tmp_path / name}", "reward.sandbox=inline", "trainer.eval_every=0",
                              "trainer.max_steps=1", "trainer.device=cpu", "algo.mini_batches=1", *over])


def test_offload_step_equals_the_on_device_step(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    # rewards 0,1,0,1... in every group: non-zero advantages, so the step really moves the weights
    monkeypatch.setattr(RewardFn, "batch", lambda self, texts, truths: [float(i % 2) for i in range(len(texts))])

    from fastcov.trainer.runtime.run_dir import read_metrics

    runs = {}
    for name, over in (("plain", ["trainer.zero_stage=2"]),
                       ("offload", ["trainer.zero_stage=2", "trainer.offload_optimizer=true"])):
        cfg = _cfg(tmp_path, name, *over)
        assert ("offload_optimizer" in ds_config(cfg, torch.device("cpu"), 1)["zero_optimization"]) == (name == "offload")
        run = train_mod.train(cfg)
        last = read_metrics(run / "metrics.jsonl")[-1]
        assert last["applied_steps"] == 1 and last["grad_norm"] > 0  # a real step was taken
        runs[name] = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    assert runs["plain"].keys() == runs["offload"].keys()
    for key, plain in runs["plain"].items():
        torch.testing.assert_close(runs["offload"][key], plain, atol=1e-6, rtol=1e-5, msg=key)


def test_offload_needs_a_zero_stage(tmp_path):
    with pytest.raises(ConfigError, match="trainer.offload_optimizer"):
        _cfg(tmp_path, "x", "trainer.offload_optimizer=true", "trainer.zero_stage=0")
