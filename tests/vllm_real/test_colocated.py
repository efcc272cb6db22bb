"""The colocated vLLM engine against the real vLLM (CPU build), through the trainer's factory: the first
weight sync (which failed before on the policy's rotary buffers), parity of vLLM's raw log-probs with fastcov's
fused kernel on the same tokens, an optimizer step, a sync, parity again and changes that track the policy's.
Each case runs in a process of its own (tests/vllm_real/colocated_case.py): one vLLM engine per process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from case_process import run_case_process

CASE = Path(__file__).with_name("colocated_case.py")
PARITY_MAX, PARITY_MEAN = 0.05, 0.01  # nats: bf16 vLLM against the bf16 policy through the fused kernel

CASES = {
    "qwen2-tied-bias-buffers": {"arch": "qwen2", "tie": True, "bias": True, "expect_buffer_error": True},
    "qwen2-untied-bias": {"arch": "qwen2", "tie": False, "bias": True},
    "llama-untied-bias-mlp-bias": {"arch": "llama", "tie": False, "bias": True},
}


def run_case(spec: dict, tmp_path: Path) -> tuple[dict, str]:
    return run_case_process(CASE, spec, tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_colocated_engine_syncs_generates_and_tracks_the_policy(name, tmp_path):
    res, log = run_case(CASES[name], tmp_path)
    assert res["engine"] == "VLLMColocatedEngine" and res["sleep_level"] == 0
    assert log.count("has no sleep mode (CUDA only)") == 1  # said once, not an error
    assert res["skip"] == sorted(res["buffers"]) and "model.rotary_emb.inv_freq" in res["skip"]
    assert res["tokens"] > 0 and res["regenerated"] > 0
    assert max(res["sync_s"]) < 5.0
    for key in ("parity_sampled", "parity_scored", "parity_after_step"):
        assert res[key]["max"] <= PARITY_MAX and res[key]["mean"] <= PARITY_MEAN, (key, res[key])
    assert res["policy_change_mean"] > 20 * PARITY_MEAN  # the step moved the policy well beyond bf16 noise
    assert res["change_corr"] > 0.99, res["change_corr"]  # and vLLM moved with it, token by token
    if CASES[name].get("expect_buffer_error"):  # the sync before the fix: vLLM's loader refuses the buffers
        assert res["buffer_error"] and "rotary_emb" in res["buffer_error"]
