"""``shutdown_distributed`` on two gloo ranks: every group a rank made, a subgroup included, ends on every rank
before the interpreter's teardown (why, and the one-process checks:
tests/trainer/runtime/test_distributed_shutdown.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _dist import free_port, set_rank_environment, spawn_ranks

pytest.importorskip("deepspeed")


def _two_ranks_with_a_subgroup(rank: int, port: int, out_dir: str) -> None:
    set_rank_environment(rank, 2, port)
    import torch
    import torch.distributed as dist

    from fastcov.trainer.runtime.distributed import all_sum, init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"))
    dist.new_group([0, 1])  # like a node group of the rollout copies
    total = all_sum([rank + 1.0], torch.device("cpu"))[0]
    shutdown_distributed()
    Path(out_dir, f"rank{rank}").write_text(f"{total} {dist.is_initialized()}")


@pytest.mark.slow
def test_shutdown_ends_every_group_on_every_rank(tmp_path):
    spawn_ranks(_two_ranks_with_a_subgroup, (free_port(), str(tmp_path)), 2)
    assert [Path(tmp_path, f"rank{r}").read_text() for r in range(2)] == ["3.0 False", "3.0 False"]
