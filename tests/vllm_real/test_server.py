"""Server mode against a real vLLM server (CPU build) started by the test as a user would
(``python -m fastcov.trainer.rollout_vllm serve``): rollouts through ``/v1/completions``, the weight sync over
fastcov's gloo backend (no NCCL on CPU; vLLM loads it through its plugin entry point), parity with the policy
after each sync, and a clean shutdown that leaves no process behind."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocated_case import ROOT, build_policy, policy_lp, stats, train_step
from server import vllm_server, write_model_dir

from fastcov.trainer.config import load_config
from fastcov.trainer.data.synthetic import build_tokenizer
from fastcov.trainer.rollout import SamplingParams, make_rollout_engine
from fastcov.trainer.runtime.weight_buckets import iter_buckets

PARITY_MAX, PARITY_MEAN = 0.05, 0.01


def sync(eng, lm) -> None:
    eng.update_weights(iter_buckets(list(lm.named_parameters()) + list(lm.named_buffers()), 256 << 10))


def test_server_rollouts_and_gloo_weight_sync(tmp_path):
    tok = build_tokenizer()
    lm = build_policy({"arch": "qwen2", "tie": False, "bias": True, "vocab": len(tok)})
    model_dir = write_model_dir(lm, tok, tmp_path / "model")
    prompts = [[5 + (7 * i + 3 * j) % 100 for j in range(4 + i % 5)] for i in range(8)]
    with vllm_server(model_dir, tmp_path / "server.log") as (url, proc):
        cfg = load_config(ROOT / "configs" / "tiny.yaml", [
            "rollout.engine=vllm", "rollout.vllm_mode=server", f"rollout.vllm_server_urls=[{url}]",
            f"trainer.run_dir={tmp_path / 'run'}", "rollout.sync_bucket_mb=0.25", "trainer.device=cpu"])
        eng = make_rollout_engine(cfg, lm, tok, device=torch.device("cpu"))
        assert type(eng).__name__ == "VLLMServerEngine" and eng.sender.backend == "fastcov_gloo"
        assert "model.rotary_emb.inv_freq" in eng.sender.skip
        sync(eng, lm)
        first = eng.generate(prompts, SamplingParams(1.0, 1.0, 12))
        assert sum(len(r) for r in first.token_ids) > 0
        before = stats(first.logprobs, policy_lp(lm, prompts, first.token_ids))
        train_step(lm, prompts, first.token_ids)
        stale = stats(first.logprobs, policy_lp(lm, prompts, first.token_ids))
        sync(eng, lm)
        second = eng.generate(prompts, SamplingParams(1.0, 1.0, 12))
        after = stats(second.logprobs, policy_lp(lm, prompts, second.token_ids))
        eng.close()
    for s in (before, after):
        assert s["max"] <= PARITY_MAX and s["mean"] <= PARITY_MEAN, (before, after)
    assert stale["mean"] > 20 * PARITY_MEAN  # the step moved the policy: parity after it is the sync's doing
    assert eng.sender.stats["sync_bytes"] > 0
    assert proc.stopped_cleanly, "the vLLM server left processes behind after SIGTERM"
