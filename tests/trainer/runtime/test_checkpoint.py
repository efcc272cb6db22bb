"""Checkpoint and run-directory guarantees, piece by piece (tests/trainer/e2e/test_fault_injection.py kills whole runs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _fixtures import ROOT, TINY

from fastcov.trainer.runtime.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    rng_state,
    set_rng_state,
)
from fastcov.trainer.runtime.run_dir import move_aside, trim_metrics


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    gens = {"sample": torch.Generator().manual_seed(5)}
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(rng_state(gens), tmp_path / "rng.pt")
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gens["sample"])))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    gens["sample"].manual_seed(9)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), gens)
    got = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gens["sample"])))
    assert got == want


def test_rng_state_with_a_cached_gaussian(tmp_path):
    np.random.seed(0)
    np.random.randn()  # numpy caches the second normal of a pair
    random.seed(0)
    random.gauss(0, 1)  # python caches one too
    torch.save(rng_state({}), tmp_path / "rng.pt")
    want = (float(np.random.randn()), random.gauss(0, 1))
    np.random.seed(5), random.seed(5)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), {})
    assert (float(np.random.randn()), random.gauss(0, 1)) == want


def _ckpt(root: Path, step: int, complete: bool = True) -> Path:
    p = root / f"step_{step:06d}"
    p.mkdir(parents=True)
    if complete:
        (p / "trainer_state.json").write_text(json.dumps({"step": step, "sampler": {}, "counters": {}}))
    return p


def test_only_complete_checkpoints_count(tmp_path):
    _ckpt(tmp_path, 1)
    _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 3, complete=False)  # no trainer_state.json: never published by the trainer
    (tmp_path / ".tmp_step_000004").mkdir()
    (tmp_path / ".del_step_000000").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001", "step_000002"]
    assert latest_checkpoint(tmp_path).name == "step_000002"


def _lines(*steps, torn: str = "") -> str:
    return "".join(json.dumps({"step": s, "x": s * 1.5}) + "\n" for s in steps) + torn


@pytest.mark.parametrize("content, last, kept, counts", [
    (_lines(0, 1, 2, 3), 3, [0, 1, 2, 3], {"kept": 4, "dropped": 0, "torn": 0}),
    (_lines(0, 1, 2, 3), 2, [0, 1, 2], {"kept": 3, "dropped": 1, "torn": 0}),
    (_lines(0, 1, 2, torn='{"step": 3, "x'), 2, [0, 1, 2], {"kept": 3, "dropped": 0, "torn": 1}),
    (_lines(0, 1, 2, 3, torn='{"st'), 2, [0, 1, 2], {"kept": 3, "dropped": 1, "torn": 1}),
    (_lines(0, 1, 2) + '{"step": 3, "x": \n', 2, [0, 1, 2], {"kept": 3, "dropped": 0, "torn": 1}),
    (_lines(0, 1, 1, 2), 2, [0, 1, 2], {"kept": 3, "dropped": 1, "torn": 0}),
    ("", 5, [], {"kept": 0, "dropped": 0, "torn": 0}),
])
def test_trim_metrics(tmp_path, content, last, kept, counts):
    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    assert trim_metrics(path, last) == counts
    text = path.read_text()
    assert text == "" or text.endswith("\n")
    assert [json.loads(ln)["step"] for ln in text.splitlines()] == kept
    assert not list(tmp_path.glob(".*.tmp"))


def test_trim_metrics_refuses_a_damaged_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_lines(0) + "garbage\n" + _lines(1, 2))
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl:2: not a metrics row"):
        trim_metrics(path, 2)
    assert path.read_bytes() == before


def test_move_aside_keeps_everything(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("x\n")
    first = move_aside(run)
    run.mkdir()
    (run / "metrics.jsonl").write_text("y\n")
    second = move_aside(run)
    assert first != second and not run.exists()
    assert (first / "metrics.jsonl").read_text() == "x\n" and (second / "metrics.jsonl").read_text() == "y\n"
    assert first.name.startswith("run.old-")


# ------------------------------------------------------------------------------------------ with training

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


def _cfg(run_dir, *extra):
    from fastcov.trainer.config import load_config

    return load_config(TINY, [f"trainer.run_dir={run_dir}", "reward.sandbox=inline", "trainer.max_steps=2",
                              "trainer.eval_every=0", "trainer.save_every=1", *extra])


def test_run_dir_is_refused_moved_aside_or_resumed(tmp_path, varied_rewards, capsys):
    from fastcov.cli import main
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.runtime.run_dir import read_metrics

    run = tmp_path / "run"
    train_mod.train(_cfg(run))
    first = (run / "metrics.jsonl").read_text()
    # a fresh run into it refuses, and changes nothing
    with pytest.raises(CheckpointError, match="already holds a run"):
        train_mod.train(_cfg(run))
    assert (run / "metrics.jsonl").read_text() == first
    # --resume of a finished run: nothing to do, the final export is redone, no duplicate rows
    train_mod.train(_cfg(run), resume=True)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    # longer run resumed from the last checkpoint
    train_mod.train(_cfg(run, "trainer.max_steps=3"), resume=True)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    # --overwrite (CLI) moves the old run aside, keeping every file
    capsys.readouterr()
    assert main(["train", str(TINY), f"trainer.run_dir={run}", "reward.sandbox=inline", "trainer.max_steps=1",
                 "trainer.eval_every=0", "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1
    assert [r["step"] for r in read_metrics(aside[0] / "metrics.jsonl")] == [1, 2, 3]
    assert (aside[0] / "final" / "config.json").is_file()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]


def test_crash_between_checkpoint_write_and_publish(tmp_path, varied_rewards, monkeypatch):
    """The step's metrics row is durable, its checkpoint is not published: resume redoes the step once."""
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.runtime.run_dir import read_metrics

    class Crash(Exception):
        pass

    real = train_mod.publish_checkpoint
    calls = {"n": 0}

    def crash_on_second(tmp, keep_last, rank):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Crash
        return real(tmp, keep_last, rank)

    run = tmp_path / "run"
    monkeypatch.setattr(train_mod, "publish_checkpoint", crash_on_second)
    with pytest.raises(Crash):
        train_mod.train(_cfg(run, "trainer.max_steps=3"))
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]  # row 2 written before publish
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000001"]
    assert (run / "checkpoints" / ".tmp_step_000002").is_dir()
    monkeypatch.setattr(train_mod, "publish_checkpoint", real)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "entr')  # and a torn line on top
    train_mod.train(_cfg(run, "trainer.max_steps=3"), resume=True)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert not list((run / "checkpoints").glob(".tmp_*"))
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000002", "step_000003"]


def test_no_weights_only_false_in_the_library():
    offenders = []
    for folder in ("fastcov", "kernels", "trainer", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if "weights_only=False" in text.replace(" ", ""):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
