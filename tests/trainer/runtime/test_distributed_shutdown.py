"""A process that started torch.distributed through ``init_distributed`` ends it on its way out, before the
interpreter's teardown (``shutdown_distributed``, at exit): a rank that left gloo's groups alive was now
and then aborted in the C++ teardown after a finished run (SIGABRT, 'terminate called without an active
exception'; tests/multinode caught it), and torchrun called the run failed. DeepSpeed's
deprecated-collective warnings stay out of the log."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from _dist import free_port, set_rank_environment, spawn_ranks, without_rank_environment

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


AT_EXIT = """
import atexit, os, sys
import torch
import torch.distributed as dist
# registered first, so it runs last: after init_distributed's handler
atexit.register(lambda: print("at exit, initialized:", dist.is_initialized(), flush=True))
from fastcov.trainer.runtime.distributed import init_distributed
print(init_distributed(torch.device("cpu")), dist.is_initialized(), flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_the_process_group_ends_before_the_interpreter_does(code):
    env = without_rank_environment()
    out = subprocess.run([sys.executable, "-c", AT_EXIT, str(code)], capture_output=True, text=True, timeout=300,
                         env={**env, "DS_ACCELERATOR": "cpu"}, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == code, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("(0, 1)", "at exit"))]
    assert lines == ["(0, 1) True", "at exit, initialized: False"], out.stdout[-3000:]


def test_deepspeeds_deprecated_collective_names_do_not_flood_the_log():
    import torch

    from fastcov.trainer.runtime.distributed import init_distributed

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        init_distributed(torch.device("cpu"))  # the filter goes in front of the ones this block set
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
            warnings.warn(f"`torch.distributed.{name}` is deprecated. Please use `torch.distributed."
                          f"{name.replace('_tensor', '_single').replace('_into', '')}` instead.", FutureWarning,
                          stacklevel=2)
        warnings.warn("`torch.distributed.something_else` is deprecated.", FutureWarning, stacklevel=2)
    assert [str(w.message) for w in seen] == ["`torch.distributed.something_else` is deprecated."]
