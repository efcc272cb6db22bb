"""bench/gpu_suite/'s train part on CPU at the tiny size: the fastcov trainer's steps and TRL's GRPOTrainer really
run, and their rows reach the JSONL and the markdown (the other parts and the pieces a GPU run depends on:
tests/benchmarks/test_gpu_suite.py)."""

from __future__ import annotations

import importlib.util

import pytest
from _fixtures import suite_markdown, suite_rows

from bench import gpu_suite as S


@pytest.mark.slow
def test_train_tiny_runs_the_trainer_and_trl(tmp_path):
    assert S.main(["--part", "train", "--size", "tiny", "--steps", "2", "--out", str(tmp_path)]) == 0
    rows = [r for r in suite_rows(tmp_path) if r["part"] == "train"]
    names = [r["name"] for r in rows]
    assert names == ["fastcov step 1", "fastcov step 2", "fastcov trainer", "trl GRPOTrainer"]
    steps = rows[:2]
    assert [r["warmup"] for r in steps] == [True, False]
    for r in steps:
        for key in ("time/rollout", "time/old_logprob", "time/update", "time/sync", "time/step"):
            assert r[key] > 0, key
        assert r["rollout_tokens_per_s"] > 0 and r["update_tokens_per_s"] > 0
        assert r["update_tokens_per_s"] == pytest.approx(r["tokens"] / r["time/update"])
    summary = rows[2]
    assert summary["status"] == "ok" and summary["steps_measured"] == [2]
    assert summary["medians"]["time/step"] == pytest.approx(steps[1]["time/step"])
    assert summary["plan"]["engine"] == "hf-copy"  # ZeRO-3: the HF engine's own copy
    assert summary["plan_peak_gib"] > 0 and summary["peak_rss_bytes"] > 0
    assert summary["peak_gpu_bytes"] is None  # no GPU here
    assert "trainer.zero_stage=3" in summary["overrides"] and "algo.mode=kl_cov" in summary["overrides"]
    trl = rows[3]
    if importlib.util.find_spec("trl") is None:
        assert trl["status"] == "unavailable" and trl["reason"] == "trl not installed"
    else:
        assert trl["status"] == "ok", trl
        assert len(trl["step_s"]) == 2 and trl["median_step_s"] == trl["step_s"][1] > 0
        assert trl["setup"]["num_generations"] == 4 and trl["setup"]["max_completion_length"] == 8
    md = suite_markdown(tmp_path)
    assert "## train" in md and "| fastcov trainer | ok |" in md
