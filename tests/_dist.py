"""Helpers for the tests that spawn local gloo processes."""

from fastcov.trainer.runtime.distributed import free_port, shutdown_distributed

__all__ = ["free_port", "shutdown_process_group", "spawn_ranks"]


def shutdown_process_group() -> None:
    """Tear the groups down before the worker exits, as ``fastcov train`` does (``shutdown_distributed``)."""
    shutdown_distributed()


def _run_rank(rank, worker, args) -> None:
    import os
    import sys

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without the interpreter's teardown: C++ destructors of gloo threads still alive there can call
    # std::terminate ('terminate called without an active exception', SIGABRT after the work was done).
    os._exit(0)


def spawn_ranks(worker, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(worker, args=args, nprocs=nprocs, join=True)``, each rank leaving by
    ``os._exit(0)`` once ``worker`` returns. A rank that raises or dies inside ``worker`` still fails the
    call; the test's own checks then read what the ranks wrote."""
    import torch.multiprocessing as mp

    mp.spawn(_run_rank, args=(worker, tuple(args)), nprocs=nprocs, join=True)
