"""torch.distributed, once: start it, ask who we are, and reduce small values across ranks.

Every helper works unchanged in one process without a process group (it then returns its input), so
the callers need no ``if world > 1`` of their own. Sums go through ``fastcov.selection.all_reduce_sum``,
the library's one in-place all-reduce.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import socket
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastcov.selection import all_reduce_sum
from fastcov.trainer.runtime.extensions import skip_shm_comm_op, take_over_stale_locks

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(choice: str) -> torch.device:
    """``trainer.device`` ('auto', 'cuda' or 'cpu') → this rank's device."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("trainer.device: 'cuda' asked for but no GPU is visible")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


DEEPSPEED_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"


def init_distributed(device: torch.device, timeout_s: float = 0.0) -> tuple[int, int]:
    """Start torch.distributed through DeepSpeed (gloo on CPU, nccl on GPU). Returns (rank, world).

    ``timeout_s``: how long a collective waits for a peer before it fails (0: DeepSpeed's default, 30
    minutes). With more than one rank, every rank's host name and address go into ``PEERS`` (for
    ``lost_peer``)."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    # DeepSpeed's ZeRO calls torch's old collective names; torch warns at each call site again and again
    # (thousands of lines in a long run's log) about code the user cannot change
    warnings.filterwarnings("ignore", message=DEEPSPEED_DEPRECATED_COLLECTIVES, category=FutureWarning)
    if not dist.is_initialized():
        take_over_stale_locks()
        if device.type == "cpu":
            skip_shm_comm_op()  # gloo does the work; its JIT load is what a kill during start-up leaves locked
        extra = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s > 0 else {}
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl",
                                   verbose=False, **extra)
        # at exit, before the interpreter's teardown (and not sooner: DeepSpeed keeps its groups for the
        # process's life, so a second run in the same process needs the first one's)
        atexit.register(shutdown_distributed, wait_for_peers=False)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.get_world_size() > 1:
        table: list = [None] * dist.get_world_size()
        dist.all_gather_object(table, (host_name(), _local_address()))
        PEERS[:] = table
    return dist.get_rank(), dist.get_world_size()


# (host name, address) of every rank, in rank order; filled by init_distributed when world > 1
PEERS: list[tuple[str, str]] = []


def host_name() -> str:
    """This rank's node: ``FASTCOV_NODE`` where set, else the host name (what node groups follow)."""
    return os.environ.get("FASTCOV_NODE") or socket.gethostname()


def _local_address() -> str:
    """The address this host reaches MASTER_ADDR from: a route look-up (connecting a UDP socket sends
    nothing). '' when there is none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
            return str(s.getsockname()[0])
    except (OSError, KeyError, ValueError):
        return ""


_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
_COLLECTIVE_FAILURE = ("gloo/transport", "ProcessGroupGloo", "Connection closed by peer", "Connection reset by peer",
                       "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


def lost_peer(exc: BaseException, rank: int) -> str | None:
    """When ``exc`` (or what it was raised from) is a collective that failed because a peer went away
    or stopped answering: which rank(s) and the failure in a few words, e.g. "rank 1 (host b,
    10.231.0.2): connection closed by peer". None for any other error."""
    failure = next((e for e in _chain(exc) if _is_collective_failure(e)), None)
    if failure is None:
        return None
    text = str(failure).strip().splitlines()[0] if str(failure).strip() else type(failure).__name__
    text = re.sub(r"^\[[^\]]*\] ?", "", text).split(". ")[0].rstrip(".")  # drop gloo's source position
    address = _PEER_ADDRESS.search(text)
    others = [r for r in range(len(PEERS)) if r != rank]
    if address:
        others = [r for r in others if PEERS[r][1] == address.group(1)] or others
    if not others:
        who = "a peer rank"
    elif len(others) == 1:
        who = f"rank {others[0]} (host {PEERS[others[0]][0]}, {PEERS[others[0]][1] or 'address unknown'})"
    else:
        who = "one of ranks " + ", ".join(str(r) for r in others)
    return f"{who}: {text[:200]}"


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(k in str(exc) for k in _COLLECTIVE_FAILURE)


def is_distributed() -> bool:
    """True when a process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``t`` ('sum' or 'max') over the default group; a no-op on one rank."""
    if not is_distributed():
        return t
    if op == "sum":
        return all_reduce_sum(t, dist.group.WORLD)
    if op == "max":
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t
    raise ValueError(f"op must be 'sum' or 'max', got {op!r}")


def barrier() -> None:
    if is_distributed():
        dist.barrier()


# Called by shutdown_distributed before it destroys the groups, newest first: what holds groups of its own on top of
# torch.distributed (a colocated vLLM engine) ends them while the default group is still alive.
_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def before_shutdown(fn: Callable[[], None]) -> None:
    """Have ``shutdown_distributed`` (and so the process's exit) call ``fn`` before the groups are destroyed."""
    _BEFORE_SHUTDOWN.append(fn)


def shutdown_distributed(wait_for_peers: bool = True) -> None:
    """End torch.distributed: (a barrier, then) every process group destroyed. ``init_distributed`` has
    the interpreter call it, without the barrier, on its way out: a process that exits with its groups
    alive leaves gloo's threads to the C++ runtime's teardown, which now and then aborts it (SIGABRT,
    'terminate called without an active exception') after a run that finished; torchrun then calls the
    run failed, and the peer may hang in its own teardown. No barrier there: a rank that leaves on an
    error must not wait for peers that never come. The ``before_shutdown`` hooks run first; one that fails
    says so in one line and the shutdown goes on."""
    while _BEFORE_SHUTDOWN:
        fn = _BEFORE_SHUTDOWN.pop()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the exit goes on; the next hook and the groups still end
            logger.warning(f"at exit: {getattr(fn, '__qualname__', fn)} failed: {type(exc).__name__}: {exc}")
    if dist.is_available() and dist.is_initialized():
        if wait_for_peers:
            barrier()
        dist.destroy_process_group()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks of a short list of floats (float64 on the wire)."""
    return all_reduce_(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


def all_max(value: int, device: torch.device) -> int:
    return int(all_reduce_(torch.tensor([value], dtype=torch.int64, device=device), "max").item())


def broadcast_text(text: str) -> str:
    """Rank 0's ``text`` on every rank (e.g. why rank 0 cannot go on, so that every rank stops with it)."""
    if not is_distributed():
        return text
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_floats(values: list[float], device: torch.device) -> list[float]:
    """Concatenation over ranks in rank order (every rank passes the same length)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if not is_distributed():
        return t.tolist()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out).tolist()
