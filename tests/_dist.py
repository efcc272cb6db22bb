"""Helpers for the tests that spawn local gloo processes: ``spawn_ranks`` starts them, ``set_rank_environment``
gives each what a launcher would, ``without_rank_environment`` is the environment of a fresh one-process job."""

import os

from bench._common import RANK_VARIABLES, rank_environment
from fastcov.trainer.runtime.distributed import free_port, shutdown_distributed

__all__ = ["free_port", "rank_environment", "set_rank_environment", "shutdown_process_group", "spawn_ranks",
           "without_rank_environment"]


def set_rank_environment(rank: int, world: int, port: int, **extra: str) -> None:
    """In a spawned rank, before torch.distributed starts: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, DeepSpeed's
    CPU accelerator, one OpenMP thread, then ``extra`` (``bench._common.rank_environment``, which the benchmarks use)."""
    os.environ.update(rank_environment(rank, world, port, **extra))


def without_rank_environment(*also: str) -> dict[str, str]:
    """This process's environment without a launcher's variables (nor ``also``): a subprocess started with it is a
    fresh one-process job, not a rank of the rendezvous an in-process test started here."""
    drop = set(RANK_VARIABLES) | set(also)
    return {k: v for k, v in os.environ.items() if k not in drop}


def shutdown_process_group() -> None:
    """Tear the groups down before the worker exits, as ``fastcov train`` does (``shutdown_distributed``)."""
    shutdown_distributed()


def _run_rank(rank, worker, args) -> None:
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
