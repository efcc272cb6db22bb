"""A refactor of the loop changes no number: the tiny config trained by this checkout and by a reference commit
(``FASTCOV_REFERENCE``, a git ref; default ``main``) writes the same metrics.jsonl, every entry but the timings
(``VOLATILE``) equal exactly, in the same order. Two runs cover the loop's branches: a synchronous one with KL-Cov,
the target-entropy controller, Jin et al.'s λ schedule, entropy-based advantage shaping, DAPO's refill, evaluation
and checkpoints; and an asynchronous one (rollout.async one_step) with LoRA (the sync's bytes), REINFORCE++'s
token-level KL, the rollout correction and the controller on λ. Both trees run in subprocesses on this machine, so
exactness does not depend on the CPU. Skipped where there is nothing to compare (no git, the ref unknown, or this
checkout is the ref with no change)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
from _fixtures import ROOT, TINY, VOLATILE  # noqa: E402

REFERENCE = os.environ.get("FASTCOV_REFERENCE", "main")

SYNC = ["algo.mode=kl_cov", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=2",
        "algo.entropy_control.target=2.0", "algo.entropy_control.knob=kl_cov_coef",
        "algo.entropy_control.delta=0.05", "algo.pos_weight.enabled=true", "algo.pos_weight.target_entropy=2.0",
        "algo.entropy_advantage.alpha=0.1", "algo.dapo_filter=true", "algo.max_gen_batches=2"]
ASYNC = ["rollout.async=one_step", "trainer.max_steps=3", "trainer.eval_every=2", "trainer.save_every=1",
         "model.lora_rank=4", "model.lora_alpha=8", "optim.lr=1e-2", "algo.adv_estimator=reinforce_pp",
         "algo.kl_coef=0.5", "algo.mode=clip_cov", "algo.entropy_control.target=6.0",
         "algo.entropy_control.knob=pos_weight", "algo.entropy_control.delta=0.1"]

# Runs in a fresh interpreter: rewards odd-length responses (an untrained model never answers right) and trains.
RUNNER = """
import json, sys
import fastcov.trainer
assert fastcov.trainer.__file__.startswith(sys.argv[1]), fastcov.trainer.__file__
from fastcov.trainer.config import load_config
from fastcov.trainer.rewards import RewardFn
from fastcov.trainer.train import train
RewardFn.__call__ = lambda self, text, truth: float(len(text) % 2)
train(load_config(sys.argv[2], json.loads(sys.argv[3])))
"""


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _reference_tree(dest: Path) -> Path:
    """The reference commit's fastcov laid out as installed (kernels/, trainer/, configs/ inside fastcov/)."""
    archive = dest / "ref.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), REFERENCE], check=True, timeout=120)
    src = dest / "src"
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    site = dest / "site"
    shutil.copytree(src / "fastcov", site / "fastcov")
    for sub in ("kernels", "trainer", "configs"):
        shutil.copytree(src / sub, site / "fastcov" / sub)
    return site


def _train(code_root: Path, pythonpath: str | None, run_dir: Path, overrides: list[str]) -> list[dict]:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath  # before the editable install's finder (appended to sys.meta_path)
    over = [f"trainer.run_dir={run_dir}", "reward.sandbox=inline", *overrides]
    res = subprocess.run([sys.executable, "-c", RUNNER, str(code_root), str(TINY), json.dumps(over)],
                         cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [SYNC, ASYNC], ids=["sync", "async"])
def test_metrics_match_the_reference_commit(tmp_path, overrides):
    head, ref = _git("rev-parse", "HEAD"), _git("rev-parse", "--verify", "--quiet", f"{REFERENCE}^{{commit}}")
    if head is None or ref is None:
        pytest.skip(f"no git checkout with the reference {REFERENCE!r} (FASTCOV_REFERENCE)")
    if head == ref and not _git("status", "--porcelain", "--", "fastcov", "kernels", "trainer"):
        pytest.skip(f"this checkout is {REFERENCE!r}: nothing to compare")
    site = _reference_tree(tmp_path)
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    ours = _train(ROOT / "trainer", None, tmp_path / "ours" / "run", overrides)
    theirs = _train(site / "fastcov" / "trainer", str(site), tmp_path / "theirs" / "run", overrides)
    assert [list(r) for r in ours] == [list(r) for r in theirs]  # the same entries, in the same order
    differ = [(r["step"], k, v, t[k]) for r, t in zip(ours, theirs, strict=True) for k, v in r.items() if t[k] != v]
    assert not differ, f"(step, metric, ours, {REFERENCE}'s): {differ[:8]}"
    steps = int(next(o for o in overrides if o.startswith("trainer.max_steps=")).split("=")[1])
    assert [r["step"] for r in ours][-1] == steps and "entropy_control/value" in ours[-1]  # the controller ran
