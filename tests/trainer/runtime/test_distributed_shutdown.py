"""A process that started torch.distributed through ``init_distributed`` ends it on its way out, before the
interpreter's teardown (``shutdown_distributed``, at exit): a rank that left gloo's groups alive was now
and then aborted in the C++ teardown after a finished run (SIGABRT, 'terminate called without an active
exception'; tests/multinode caught it), and torchrun called the run failed. DeepSpeed's
deprecated-collective warnings stay out of the log. Two ranks with a subgroup:
tests/trainer/e2e/test_distributed_shutdown_e2e.py."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from _dist import without_rank_environment

pytest.importorskip("deepspeed")


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
