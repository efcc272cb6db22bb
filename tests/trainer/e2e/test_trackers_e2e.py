"""trainer.report_to on two gloo ranks: accelerate's trackers open on rank 0 alone, one TensorBoard writer, no hang
(one process, the old booleans and the errors: tests/trainer/runtime/test_trackers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fixtures import TINY

from fastcov.trainer.config import load_config


def _two_rank_body(run_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fastcov.trainer import train as train_mod

    train_mod.train(load_config(TINY, [f"trainer.run_dir={run_dir}", "reward.sandbox=inline", "trainer.eval_every=2",
                                       "trainer.max_steps=2", "trainer.report_to=[tensorboard]"]))
    events = EventAccumulator(str(Path(run_dir) / "tensorboard"))
    events.Reload()
    return {"entropy_steps": [e.step for e in events.Scalars("entropy")]}


@pytest.mark.slow
def test_two_ranks_rank_zero_opens_the_trackers(tmp_path):
    """accelerate's process state starts on rank 0 alone, inside the gloo group the run started: no hang, one
    writer."""
    pytest.importorskip("tensorboard", reason="the [tensorboard] extra")
    from _dist import free_port, read_rank_reports, report_rank, spawn_ranks

    spawn_ranks(report_rank, (2, free_port(), str(tmp_path), _two_rank_body, str(tmp_path / "run")), 2)
    assert [r["entropy_steps"] for r in read_rank_reports(tmp_path, 2)] == [[1, 2], [1, 2]]
    assert len(list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 1
