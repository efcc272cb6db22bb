"""torch.distributed, once: start it, ask who we are, and reduce small values across ranks.

Every helper works unchanged in one process without a process group (it then returns its input), so
the callers need no ``if world > 1`` of their own. Sums go through ``fastcov.selection.all_reduce_sum``,
the library's one in-place all-reduce.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from fastcov.selection import all_reduce_sum


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


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Start torch.distributed through DeepSpeed (gloo on CPU, nccl on GPU). Returns (rank, world)."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl",
                                   verbose=False)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size()


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
