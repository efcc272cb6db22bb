"""Asynchronous rollouts against the synchronous loop on CPU: the demo's task and warm start, the same cores for
every arm.

    python -m bench.async                       # 9 arms x 3 seeds x 40 steps (docs/async.md gives the time)
    python -m bench.async --smoke               # off, one_step, stream_2; 1 seed, 3 steps: proves the pipeline
    python -m bench.async --arms off,one_step --seeds 0 --steps 20 --reuse-sft

Arms (every run a fresh ``fastcov train`` process, pinned with its engine process to ``--cpus``, default the first
two of this process's CPUs, so every arm has the same two cores):

* ``off``: the synchronous loop, ``trainer.threads=2``: generation and training take both cores in turn;
* ``one_step``: ``rollout.async=one_step``, ``trainer.threads=1`` and the engine process's one thread;
* ``stream_k``: ``rollout.async=stream``, ``max_staleness`` = ``queue_size`` = k for k = 1, 2, 4, sync every step;

each asynchronous arm with the rollout correction (the default, ``+corr``) and without it (``-corr``). The common
settings are the demo's (16 prompts x 8 answers, 8 mini-batches) with no evaluation or checkpoint in the loop.

Per run, from its metrics.jsonl, over the loop's wall time (the sum of ``time/step``; start-up excluded):
optimizer steps per second, generated response tokens per second (``async/generated_tokens``: dropped batches
count), and reward per sample drawn (the training reward's mean over every sample generated, a dropped one
counting as drawn and not rewarded). Mean over seeds with 95% intervals (Student's t, as the studies give them) and
each arm's steps/s over ``off``'s. Results: ``<out>/async-cpu-<date>.{json,md}`` and, from the first seed's
``timeline.jsonl`` of ``off`` and ``one_step``, the timeline picture (``--figure``, docs/async.md).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._common import fmt, log

ASYNC_ARMS = {"one_step": ["rollout.async=one_step"],
              **{f"stream_{k}": ["rollout.async=stream", f"rollout.max_staleness={k}", f"rollout.queue_size={k}"]
                 for k in (1, 2, 4)}}
ARMS: dict[str, list[str]] = {"off": ["trainer.threads=2"]}
for _name, _over in ASYNC_ARMS.items():
    ARMS[f"{_name}+corr"] = [*_over, "trainer.threads=1", "algo.rollout_correction.enabled=true"]
    ARMS[f"{_name}-corr"] = [*_over, "trainer.threads=1", "algo.rollout_correction.enabled=false"]
COMMON = ["trainer.eval_every=0", "trainer.save_every=0", "trainer.save_every_minutes=0", "trainer.progress=false",
          "trainer.timeline=true", "algo.mode=vanilla"]
SMOKE_ARMS = ["off", "one_step+corr", "stream_2+corr"]
PHASE_COLORS = {"rollout": "#1f77b4", "reward": "#aec7e8", "old_logprob": "#ff7f0e", "update": "#d62728",
                "sync": "#9467bd", "generate": "#2ca02c", "push": "#8c564b", "token_rewards": "#bcbd22"}


def prepare(work: Path, sft_steps: int | None, reuse: bool) -> list[str]:
    """The demo's task and warm-start model under ``work`` (as ``setup: demo`` of the studies); their overrides."""
    from fastcov.trainer.experiments import demo

    data_dir, sft_dir = work / "data", work / "sft"
    if not (reuse and (data_dir / "train.parquet").exists()):
        demo.write_task(data_dir, 2000, 512, 2, 20, seed=0)
    if not (reuse and (sft_dir / "model" / "config.json").exists()):
        steps = sft_steps if sft_steps is not None else demo.SFTConfig.steps
        log(f"[bench.async] warm start: {steps} supervised steps of the demo's tiny Qwen2")
        demo.warm_start(sft_dir, data_dir, demo.SFTConfig(steps=steps), 2, 20)
    return [f"model.path={sft_dir / 'model'}", f"data.train_files=[{data_dir / 'train.parquet'}]",
            f"data.val_files=[{data_dir / 'val.parquet'}]"]


def _train_process(run_dir: Path, overrides: list[str], cpus: set[int]) -> float:
    """One ``fastcov train`` process pinned to ``cpus`` (its engine process inherits the pinning); its wall seconds,
    start-up included."""
    cmd = [sys.executable, "-m", "fastcov.cli", "train", "configs/demo.yaml", *overrides,
           f"trainer.run_dir={run_dir}", "--overwrite"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["DS_ACCELERATOR"] = "cpu"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir}: fastcov train exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return time.perf_counter() - t0


def run_numbers(run_dir: Path, prompts_per_step: int, n: int) -> dict[str, float]:
    """Throughput and reward per sample drawn of one finished run (module docstring)."""
    from fastcov.trainer.runtime.run_dir import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step", 0) > 0 and "time/step" in r]
    seconds = sum(r["time/step"] for r in rows)
    steps = sum(r["applied_steps"] for r in rows)
    scored = [prompts_per_step * n * r["gen_batches"] for r in rows]
    tokens = sum(r.get("async/generated_tokens", r["response_len"] * s) for r, s in zip(rows, scored, strict=True))
    dropped = rows[-1].get("stale_dropped", 0) if rows else 0
    reward = sum(r["reward_mean"] * s for r, s in zip(rows, scored, strict=True))
    return {"seconds": seconds, "steps_per_s": steps / seconds, "tokens_per_s": tokens / seconds,
            "reward_per_sample": reward / max(sum(scored) + dropped, 1), "dropped": dropped,
            "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in rows) / max(len(rows), 1)}


def summarise(numbers: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    from fastcov.trainer.experiments.study_report import mean_ci

    off = numbers.get("off")
    out = {}
    for arm, runs in numbers.items():
        row: dict[str, Any] = {}
        for key in ("steps_per_s", "tokens_per_s", "reward_per_sample", "staleness_mean", "dropped"):
            row[key] = mean_ci([r[key] for r in runs])
        if off:
            ratios = [r["steps_per_s"] / o["steps_per_s"] for r, o in zip(runs, off, strict=False)]
            row["speedup"] = mean_ci(ratios)
        out[arm] = row
    return out


def markdown(summary: dict, machine: str, args, started: str) -> str:
    lines = [f"# Asynchronous rollouts on CPU ({started})", "",
             f"`python -m bench.async {' '.join(args.argv)}` on {machine}, pinned to CPUs {sorted(args.cpus)}; "
             f"{args.steps} steps, seeds {args.seeds}; mean ± 95% interval over seeds."
             + (" A smoke run: it proves the pipeline at a toy size; its ratios are not measurements." if args.smoke
                else ""), "",
             "| arm | steps/s | × off | generated tokens/s | reward per sample drawn | staleness | dropped |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def cell(pair, spec):
        mean, half = pair
        return fmt(mean, spec) + ("" if half is None else " ± " + fmt(half, spec))

    for arm, row in summary.items():
        lines.append(f"| {arm} | {cell(row['steps_per_s'], '.3f')} | "
                     f"{cell(row['speedup'], '.2f') if 'speedup' in row else '—'} | {cell(row['tokens_per_s'], '.0f')} "
                     f"| {cell(row['reward_per_sample'], '.3f')} | {cell(row['staleness_mean'], '.2f')} | "
                     f"{cell(row['dropped'], '.0f')} |")
    return "\n".join(lines) + "\n"


def plot_timeline(runs: dict[str, Path], path: Path, steps: tuple[int, int]) -> Path | None:
    """Trainer and engine lanes of each run (``timeline.jsonl``) over ``steps`` [first, last], one panel per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # one time axis for every panel: the same steps take the lengths they took
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 * len(runs) + 0.8), squeeze=False, sharex=True)
    seen: set[str] = set()
    for ax, (label, run_dir) in zip(axes[:, 0], runs.items(), strict=True):
        spans = [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines() if x.strip()]
        spans = [s for s in spans if steps[0] <= s["step"] <= steps[1]]
        if not spans:
            continue
        t0 = min(s["start"] for s in spans)
        for s in spans:
            y = 1 if s["lane"] == "trainer" else 0
            color = PHASE_COLORS.get(s["phase"], "#7f7f7f")
            ax.barh(y, s["end"] - s["start"], left=s["start"] - t0, height=0.6, color=color,
                    label=s["phase"] if s["phase"] not in seen else None)
            seen.add(s["phase"])
        ax.set_yticks([0, 1], ["engine", "trainer"])
        ax.set_title(f"{label}, steps {steps[0]}-{steps[1]}" + (" (the trainer's rollout: its own generation)"
                                                                if label == "off" else ""), fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds")
    fig.legend(loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=None, help=f"comma-separated, of: {', '.join(ARMS)} (default all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help=f"{', '.join(SMOKE_ARMS)}; seed 0; 3 steps; 20 SFT steps")
    ap.add_argument("--work", default="runs/bench-async", help="the task, the warm start and the runs")
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--reuse-sft", action="store_true", help="keep a task and warm start already in --work")
    ap.add_argument("--cpus", default=None, help="CPU ids every run is pinned to (default: the first two)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--figure", default="docs/async/timeline.png")
    ap.add_argument("--timeline-steps", type=int, nargs=2, default=None, metavar=("FIRST", "LAST"))
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    if args.smoke:
        args.arms, args.seeds, args.steps = ",".join(SMOKE_ARMS), [0], 3
        args.sft_steps = 20 if args.sft_steps is None else args.sft_steps
    arms = [a.strip() for a in (args.arms or ",".join(ARMS)).split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"bench.async: unknown arm(s) {', '.join(unknown)}; arms: {', '.join(ARMS)}", file=sys.stderr)
        return 2
    mine = sorted(os.sched_getaffinity(0))
    args.cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else set(mine[:2])
    from fastcov.trainer.config import load_config
    from fastcov.trainer.experiments.demo import cpu_model

    work = Path(args.work)
    setup = prepare(work, args.sft_steps, args.reuse_sft)
    started = _dt.date.today().isoformat()
    numbers: dict[str, list[dict[str, float]]] = {}
    runs = [(a, s) for s in args.seeds for a in arms]  # seed-major: a slow drift of the machine hits every arm
    t_all = time.perf_counter()
    from tqdm.auto import tqdm

    for i, (arm, seed) in enumerate(tqdm(runs, desc="bench.async", unit="run")):
        over = [*setup, *COMMON, *ARMS[arm], f"trainer.max_steps={args.steps}", f"trainer.seed={seed}"]
        cfg = load_config("configs/demo.yaml", over)  # checked here: a bad arm fails before any run
        run_dir = work / "runs" / arm / f"seed{seed}"
        wall = _train_process(run_dir, over, args.cpus)
        got = run_numbers(run_dir, cfg.trainer.prompts_per_step, cfg.rollout.n)
        got["wall_s"] = wall
        numbers.setdefault(arm, []).append(got)
        log(f"[bench.async] {i + 1}/{len(runs)} {arm} seed {seed}: {got['steps_per_s']:.3f} steps/s, "
            f"{got['tokens_per_s']:.0f} tokens/s, reward/sample {got['reward_per_sample']:.3f} ({wall:.0f} s)")
    summary = summarise(numbers)
    machine = cpu_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"async-cpu-{'smoke-' if args.smoke else ''}{started}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"machine": machine, "argv": argv, "cpus": sorted(args.cpus), "steps": args.steps, "seeds": args.seeds,
         "runs": numbers, "summary": summary, "wall_s": time.perf_counter() - t_all}, indent=1))
    text = markdown(summary, machine, args, started)
    stem.with_suffix(".md").write_text(text)
    print(text)
    pics = {a: work / "runs" / a / f"seed{args.seeds[0]}" for a in ("off", "one_step+corr") if a in arms}
    if pics and args.figure:
        first, last = args.timeline_steps or (2, min(args.steps, 4))
        where = plot_timeline(pics, Path(args.figure), (first, last))
        if where is not None:
            log(f"[bench.async] timeline: {where}")
    log(f"[bench.async] results: {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
