"""Helpers for the tests that spawn local gloo processes."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_process_group() -> None:
    """Tear the group down before the worker exits: a worker that exits with gloo/DeepSpeed threads
    still running can abort in C++ teardown ('terminate called without an active exception')."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
