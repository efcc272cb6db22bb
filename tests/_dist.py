"""Helpers for the tests that spawn local gloo processes: ``spawn_ranks`` starts them, ``set_rank_environment``
gives each what a launcher would, ``without_rank_environment`` is the environment of a fresh one-process job."""

import json
import os
from pathlib import Path

from bench._common import RANK_VARIABLES, rank_environment
from fastcov.trainer.runtime.distributed import free_port, shutdown_distributed

__all__ = ["free_port", "rank_environment", "read_rank_reports", "report_rank", "set_rank_environment",
           "shutdown_process_group", "spawn_ranks", "without_rank_environment"]


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


def report_rank(rank: int, world: int, port: int, out_dir: str, body, *args) -> None:
    """A spawned rank (``spawn_ranks(report_rank, (world, port, out_dir, body, *args), world)``) with a launcher's
    environment and one torch thread that writes what ``body(*args)`` returns (a JSON-able dict), or the traceback it
    raised, to ``out_dir/rank{rank}.json`` for ``read_rank_reports``, then tears the process groups down and leaves."""
    set_rank_environment(rank, world, port, LOCAL_WORLD_SIZE=str(world))
    import traceback

    import torch

    torch.set_num_threads(1)
    try:
        result = body(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails naming it
        result = {"error": "".join(traceback.format_exception(exc))}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        shutdown_process_group()
    finally:
        os._exit(0)  # gloo/DeepSpeed threads can abort a normal interpreter exit


def read_rank_reports(out_dir, world: int) -> list[dict]:
    """What each of ``world`` ``report_rank`` ranks wrote, in rank order; fails naming the rank and its traceback
    where one raised."""
    reports = []
    for rank in range(world):
        res = json.loads(Path(out_dir, f"rank{rank}.json").read_text())
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        reports.append(res)
    return reports
