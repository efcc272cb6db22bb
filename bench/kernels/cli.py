"""Kernel benchmark: fastcov's fused log-prob/entropy vs naive PyTorch and the peers.

    python -m bench.kernels                         # qwen2.5-7b on CUDA, cpu-small without CUDA
    python -m bench.kernels --preset cpu-small      # what `make bench` runs (2 CPU cores, < 2 min)
    python -m bench.kernels --preset gpu            # qwen2.5-7b and qwen2.5-32b, N in {4k, 16k, 64k}
    python -m bench.kernels --preset qwen2.5-7b --n 4096 16384 --impls naive fastcov-triton verl

Per case (implementation x shape) it records the median forward (no_grad: the old/ref log-prob
pass) and forward+backward (upstream sum g*logprob + e*entropy, grads w.r.t. hidden and weight)
times, effective TFLOP/s (2NDV and 8NDV), the share of the measured plain matmul rate in the same
run, the peak memory increment, and ratios against naive in the same run. It also checks each
implementation's log-prob/entropy on a few rows against float64, so a fast-but-wrong kernel shows.
Results: <out>/<device>-<date>.json and .md (runs of other presets on the same day are kept).
See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
import time
from pathlib import Path

import torch

from bench import _measure as M
from bench._common import log
from bench.kernels.case import case_main
from bench.kernels.measure import run_preset
from bench.kernels.presets import PRESET_ALIASES, PRESETS, resolve_presets
from bench.kernels.render import case_line, jsonl_path, read_jsonl, render_jsonl_md, write_results
from bench.peers import DEFAULT_IMPLS, IMPLS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(PRESET_ALIASES),
                   help="default: qwen2.5-7b with CUDA, cpu-small without")
    p.add_argument("--n", type=int, nargs="+", help="token counts, replacing the preset's")
    p.add_argument("--d", type=int, help="hidden size, replacing the preset's")
    p.add_argument("--v", type=int, help="vocabulary size, replacing the preset's")
    p.add_argument("--impls", nargs="+", metavar="IMPL",
                   help=f"subset of {', '.join(IMPLS)} (default: {' '.join(DEFAULT_IMPLS)})")
    p.add_argument("--repeats", type=int, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, help="untimed iterations before timing")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="replacing the preset's")
    p.add_argument("--threads", type=int, help="torch intra-op threads (0: torch's default; "
                   "cpu-small uses 1, see PRESETS)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--isolate", choices=["auto", "always", "never"], default="auto",
                   help="auto: on CPU, timing in one subprocess per shape and memory in a fresh "
                        "subprocess per case (peak RSS needs a fresh process); on CUDA, all in this process")
    p.add_argument("--case-timeout", type=float, default=600.0, help="seconds, per isolated case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="results folder (default bench/results)")
    p.add_argument("--render", metavar="JSONL", help="only write the markdown of a results .jsonl (next to it)")
    p.add_argument("--jsonl", metavar="PATH", help="append the per-case JSON lines here (default "
                   "<out>/<device>/kernels-<date>.jsonl; gpu_run.sh puts them straight into $OUT)")
    p.add_argument("--_case", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._case:
        return case_main(args._case)
    if args.render:
        src = Path(args.render)
        if not src.is_file():
            log(f"error: --render {src}: no such file")
            return 2
        dst = src.with_suffix(".md")
        dst.write_text(render_jsonl_md(read_jsonl(src)))
        log(f"wrote {dst}")
        return 0
    if args.impls:
        args.impls = list(dict.fromkeys(i for a in args.impls for i in a.split(",") if i))
        unknown = [i for i in args.impls if i not in IMPLS]
        if unknown:
            log(f"error: unknown --impls {unknown}; choose from {', '.join(IMPLS)}")
            return 2
    has_cuda = torch.cuda.is_available()
    preset = args.preset or ("qwen2.5-7b" if has_cuda else "cpu-small")
    names = resolve_presets(preset)
    wanted = {PRESETS[n]["device"] for n in names}
    if args.device != "auto":
        dev = args.device
    elif wanted == {"cpu"}:
        dev = "cpu"
    else:
        dev = "cuda" if has_cuda else "cpu"
    if dev == "cuda" and not has_cuda:
        log("error: CUDA requested but torch.cuda.is_available() is False")
        return 2
    if "cuda" in wanted and dev != "cuda" and args.device == "auto":
        log(f"error: preset {preset} is for CUDA (bf16, Qwen2.5 shapes); this machine has no CUDA device. "
            "Use --preset cpu-small, or --device cpu to force it.")
        return 2
    device = torch.device(dev)
    env = M.env_info(device)
    date = _dt.date.today().isoformat()
    cmd = "python -m bench.kernels " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    log(f"fastcov bench: {env['device_name']}; torch {env['torch']}, triton {env['triton']}; presets {names}")
    out_dir = Path(args.out)
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    lines_path = Path(args.jsonl).absolute() if args.jsonl else jsonl_path(out_dir, env, date)
    for name in names:
        started = _dt.datetime.now().isoformat(timespec="seconds")
        t0 = time.perf_counter()
        matmul_seen: dict = {}

        def on_case(row, name=name, matmul_seen=matmul_seen):
            M.append_jsonl(lines_path, case_line(row, name, matmul_seen, env, cmd.strip(), date))

        run = run_preset(name, args, device, on_case=on_case, matmul_out=matmul_seen)
        run.update(command=cmd.strip(), started=started, wall_s=time.perf_counter() - t0, env=env)
        jpath, mpath = write_results(run, out_dir, env, date)
        lines_path.with_suffix(".md").write_text(render_jsonl_md(read_jsonl(lines_path)))
        log(f"{name}: {run['wall_s']:.1f} s; wrote {jpath}, {mpath} and {lines_path} (+ .md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
