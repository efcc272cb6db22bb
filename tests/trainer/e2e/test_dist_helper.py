"""tests/_dist.spawn_ranks: a rank's results survive its os._exit, and a rank that fails still fails the call."""

from pathlib import Path

import pytest
import torch.multiprocessing as mp
from _dist import spawn_ranks


def _writes(rank, out_dir):
    Path(out_dir, f"rank{rank}.txt").write_text(str(rank * 7))


def _fails_on_rank1(rank, out_dir):
    if rank == 1:
        raise RuntimeError("rank 1 broke")
    Path(out_dir, f"rank{rank}.txt").write_text("ok")


def _dies_on_rank0(rank, out_dir):
    import os

    if rank == 0:
        os.abort()


@pytest.mark.slow
def test_spawn_ranks_keeps_results_and_fails_on_a_broken_rank(tmp_path):
    spawn_ranks(_writes, (str(tmp_path),), 2)
    assert [Path(tmp_path, f"rank{r}.txt").read_text() for r in range(2)] == ["0", "7"]
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 broke"):
        spawn_ranks(_fails_on_rank1, (str(tmp_path),), 2)
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn_ranks(_dies_on_rank0, (str(tmp_path),), 2)
