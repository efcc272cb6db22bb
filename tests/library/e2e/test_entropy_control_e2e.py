"""The target-entropy controller's all-rank entropy (fastcov.entropy_control.all_rank_entropy) on 2 gloo processes
equals one process's on the whole batch (the rules and the shaping: tests/library/test_entropy_control.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _dist import free_port, shutdown_process_group, spawn_ranks

from fastcov.entropy_control import all_rank_entropy

WORLD = 2


def _entropy_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    try:
        gen = torch.Generator().manual_seed(11)
        ent = torch.rand(7, 13, generator=gen, dtype=torch.float32) * 3
        mask = torch.rand(7, 13, generator=gen) < 0.6
        rows = [slice(0, 2), slice(2, 7)][rank]  # uneven shares of the tokens
        local = (ent[rows] * mask[rows]).double().sum()
        result["entropy"] = all_rank_entropy(local, mask[rows].sum(), group=dist.group.WORLD)
        result["empty"] = all_rank_entropy(0.0, 0, group=dist.group.WORLD)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result["error"] = repr(exc)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown_process_group()


@pytest.mark.slow
def test_all_rank_entropy_on_two_ranks_equals_one_process(tmp_path):
    spawn_ranks(_entropy_worker, (WORLD, free_port(), str(tmp_path)), WORLD)
    gen = torch.Generator().manual_seed(11)
    ent = torch.rand(7, 13, generator=gen, dtype=torch.float32) * 3
    mask = torch.rand(7, 13, generator=gen) < 0.6
    single = all_rank_entropy((ent * mask).double().sum(), mask.sum())
    assert single == pytest.approx(float((ent * mask).double().sum() / mask.sum()), rel=1e-15)
    for rank in range(WORLD):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in res, res
        assert res["entropy"] == pytest.approx(single, rel=1e-14) and res["empty"] == 0.0
