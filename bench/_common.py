"""What the benchmarks share: console lines, exception summaries, table cells, the result-marker protocol by which
a benchmark's subprocess hands its result back, and the environment of a rank a benchmark or a test starts itself
(tests/_dist.py uses it). Nothing here imports fastcov, a peer, or torch at import time.

The protocol: the subprocess prints one stdout line ``<mark><JSON>`` as its last word (``emit_result``); the
parent takes the last such line of what it printed (``read_result``), so that whatever else the subprocess or
its libraries print around it does not matter. Each benchmark names its own mark.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


def log(msg: str, prefix: str = "") -> None:
    """One progress line on stderr (stdout carries results), flushed at once."""
    print(prefix + msg, file=sys.stderr, flush=True)


def short(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (whitespace runs collapsed), at most ``limit`` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_oom(exc: BaseException) -> bool:
    """torch's out-of-memory error, or any error whose message says "out of memory" (CUDA, allocators)."""
    import torch  # here, so that the helpers load without torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fmt(x: Any, spec: str, suffix: str = "") -> str:
    """A table cell: ``x`` formatted with ``spec`` and ``suffix``, an em dash for None."""
    return "—" if x is None else format(x, spec) + suffix


def emit_result(mark: str, result: Any, default: Callable[[Any], Any] | None = None) -> None:
    """Print ``result`` as the subprocess's result line, ``mark`` + JSON, and flush."""
    print(mark + json.dumps(result, default=default), flush=True)


def read_result(stdout: str, mark: str) -> Any | None:
    """The result a subprocess printed with ``emit_result``: its last ``mark`` line; None without one (or
    when that line is not JSON: a process killed mid-write)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(mark):
            try:
                return json.loads(line[len(mark):])
            except json.JSONDecodeError:
                return None
    return None


# what a launcher (torchrun, deepspeed) sets per rank: a process started without them is a fresh one-process job
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_environment(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The variables a launcher gives rank ``rank`` of ``world`` processes on this host, rendezvous at
    127.0.0.1:``port``, with DeepSpeed's CPU accelerator and one OpenMP thread, then ``extra``: for the processes a
    benchmark or a test spawns itself (``os.environ.update(...)`` in each, before torch starts its threads)."""
    return {"DS_ACCELERATOR": "cpu", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **extra}
