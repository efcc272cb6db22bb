"""The trainer on the real vLLM (CPU build): ``fastcov train configs/tiny.yaml rollout.engine=vllm`` for a few
steps, colocated and against a server, then ``--resume``; the rollout/policy mismatch in metrics.jsonl stays at
bf16 parity (a broken sync would show as a jump). The tiny model is widened to head_dim 64 (vLLM's CPU
attention)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import vllm_server, write_model_dir

ROOT = Path(__file__).resolve().parents[2]
WIDE = ["model.arch.hidden_size=128", "model.arch.intermediate_size=256"]  # 2 heads: head_dim 64
MISMATCH_MAX = 0.05  # nats: bf16 vLLM against the fp32 policy on CPU


def train(run_dir: Path, steps: int, extra: list[str], resume: bool = False) -> str:
    cmd = [sys.executable, "-m", "fastcov.cli", "train", str(ROOT / "configs" / "tiny.yaml"), "rollout.engine=vllm",
           f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}", "trainer.save_every=1", *WIDE, *extra]
    cmd += ["--resume"] if resume else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]  # vLLM's teardown at exit included
    return proc.stdout + proc.stderr


def check_metrics(run_dir: Path, steps: int) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in rows if r.get("step", 0) > 0]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    for r in trained:
        assert 0 < r["rollout_logprob_diff_mean"] <= r["rollout_logprob_diff_max"] <= MISMATCH_MAX, r
        assert r["rollout_logprob_diff_mean"] == r["rollout_logprob_diff"]
        # the rollout correction is on by default with vLLM (algo.rollout_correction): its metrics, finite
        corr = {k: v for k, v in r.items() if k.startswith("rollout_corr/")}
        assert "rollout_corr/rollout_is_mean" in corr and "rollout_corr/kl" in corr, sorted(r)
        assert all(math.isfinite(v) for v in corr.values()), corr
        assert abs(corr["rollout_corr/rollout_is_mean"] - 1) < 0.1, corr  # bf16 parity: weights near 1


def tiny_model_dir(path: Path) -> Path:
    """The model tiny.yaml (widened) builds, as a config directory a dummy-weight server starts from."""
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.model import build_model, load_tokenizer

    cfg = load_config(ROOT / "configs" / "tiny.yaml", WIDE)
    tok = load_tokenizer(cfg.model)
    return write_model_dir(build_model(cfg.model, torch.device("cpu"), torch.float32, tok), tok, path)


@pytest.mark.parametrize("mode", ["colocated", "server"])
def test_fastcov_train_on_vllm_then_resume(mode, tmp_path):
    run_dir = tmp_path / "run"
    if mode == "colocated":
        log = train(run_dir, 2, [])
        assert log.count("has no sleep mode") == 1
        log = train(run_dir, 3, [], resume=True)
    else:
        with vllm_server(tiny_model_dir(tmp_path / "model"), tmp_path / "server.log") as (url, proc):
            extra = ["rollout.vllm_mode=server", f"rollout.vllm_server_urls=[{url}]"]
            train(run_dir, 2, extra)
            log = train(run_dir, 3, extra, resume=True)
        assert proc.stopped_cleanly
    assert "resumed from" in log and "step_000002" in log
    check_metrics(run_dir, 3)


def test_a_head_size_vllms_cpu_build_lacks_is_one_line_before_the_engine_starts(tmp_path):
    """tiny.yaml as it is (head_dim 16): one line naming model.arch and the sizes that work, exit 2, nothing after
    it, and no vLLM engine started (its start-up log never appears)."""
    cmd = [sys.executable, "-m", "fastcov.cli", "train", str(ROOT / "configs" / "tiny.yaml"), "rollout.engine=vllm",
           f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 2, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fastcov train: model.arch: head_dim 16 (hidden_size 32 / 2 heads) is not one vLLM's CPU "
                           "attention takes; it takes 32, 64"), proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "init engine" not in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("mode", ["one_step", "stream"])
def test_asynchronous_rollouts_against_a_server_then_resume(mode, tmp_path):
    """rollout.async against vLLM's own server (docs/async.md): generations from the trainer's background thread,
    pushes between them; from step 2 on the batches are one version old, so the rollout/policy gap is staleness plus
    bf16, not bf16 alone; a resume finishes the run."""
    run_dir = tmp_path / "run"
    with vllm_server(tiny_model_dir(tmp_path / "model"), tmp_path / "server.log") as (url, proc):
        extra = ["rollout.vllm_mode=server", f"rollout.vllm_server_urls=[{url}]", f"rollout.async={mode}"]
        train(run_dir, 2, extra)
        log = train(run_dir, 3, extra, resume=True)
    assert proc.stopped_cleanly
    assert "resumed from" in log and "step_000002" in log
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in rows if r.get("step", 0) > 0]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert trained[0]["async/staleness_max"] == 0 and all(r["async/staleness_max"] <= 1 for r in trained)
    assert trained[0]["rollout_logprob_diff_max"] <= MISMATCH_MAX  # on-policy: bf16 parity
    for r in trained:
        assert all(math.isfinite(v) for k, v in r.items() if k.startswith("rollout_corr/")), r
        assert r["async/generated_tokens"] > 0
