"""Train many configs, in turn or a few at once (one process each), with one progress bar over them.

The demo and the studies both train through ``train_runs``; a run's numbers do not depend on how many
train at once (each run's torch threads are its own ``trainer.threads``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fastcov.trainer.runtime.run_dir import last_step, metrics_path


def _train_in_worker(cfg, label: str, tag: str = "study"):
    """One run in a worker process (``--jobs`` > 1): its own distributed port, no progress bar."""
    from fastcov.trainer.runtime.distributed import free_port
    from fastcov.trainer.train import train

    os.environ["MASTER_PORT"] = str(free_port())
    t0 = time.perf_counter()
    run_dir = train(cfg, overwrite=True)
    print(f"[{tag}] {label} done in {time.perf_counter() - t0:.0f}s", flush=True)
    return run_dir, time.perf_counter() - t0


def train_runs(runs, cfgs, multi: bool, jobs: int, train, tag: str = "study"):
    """Train every (arm, seed); ``jobs`` > 1 runs that many at once, each in its own process (each run's
    numbers do not depend on it: a run's threads are ``trainer.threads``). Returns (run dirs, seconds per arm)."""
    run_dirs: dict = {}
    timings: dict[str, float] = {}

    def label(a, sd):
        cfg = cfgs[(a, sd)]
        return f"{a}" + (f" seed {sd}" if multi else "") + f" (mode {cfg.algo.mode}, {cfg.trainer.max_steps} steps)"

    if jobs == 1:
        for a, sd in runs:
            print(f"[{tag}] training {label(a, sd)}", flush=True)
            t0 = time.perf_counter()
            run_dirs[(a, sd)] = train(cfgs[(a, sd)], overwrite=True)
            timings[a] = timings.get(a, 0.0) + time.perf_counter() - t0
        return run_dirs, timings
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {}
        for a, sd in runs:
            cfg = cfgs[(a, sd)]
            cfg.trainer.progress = False  # interleaved bars from several processes say nothing
            print(f"[{tag}] queued {label(a, sd)}", flush=True)
            futures[(a, sd)] = pool.submit(_train_in_worker, cfg, label(a, sd), tag)
        _watch(futures, cfgs)
        for key, fut in futures.items():
            run_dirs[key], seconds = fut.result()
            timings[key[0]] = timings.get(key[0], 0.0) + seconds
    return run_dirs, timings


def _last_step(metrics: Path, since: float) -> int:
    """The step of the last complete row of a metrics.jsonl written after ``since`` (0 if none yet)."""
    try:
        if metrics.stat().st_mtime < since:
            return 0  # an earlier run's file, not yet moved aside
    except OSError:
        return 0
    return last_step(metrics)


def _watch(futures: dict, cfgs: dict, every_s: float = 5.0) -> None:
    """One progress bar over the steps of all runs training in worker processes, until all are done."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    from tqdm.auto import tqdm

    since = time.time()
    total = sum(cfgs[k].trainer.max_steps for k in futures)
    with tqdm(total=total, desc=f"{len(futures)} runs", unit="step", dynamic_ncols=True) as bar:
        while True:
            done, pending = wait(list(futures.values()), timeout=every_s, return_when=FIRST_EXCEPTION)
            steps = {k: cfgs[k].trainer.max_steps if f.done() else
                     _last_step(metrics_path(cfgs[k].trainer.run_dir), since) if f.running() else 0
                     for k, f in futures.items()}
            bar.n = sum(steps.values())
            running = [f"{k[0]}" + (f"/s{k[1]}" if k[1] is not None else "") + f" {n}"
                       for k, n in steps.items() if futures[k].running()]
            bar.set_postfix_str(", ".join(running), refresh=False)
            bar.refresh()
            if not pending or any(f.exception() for f in done):
                return
