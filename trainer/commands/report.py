"""`fastcov report RUN_DIR [RUN_DIR ...] [--out DIR]`."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write report.md (per run: final entropy, final validation accuracy, the fitted entropy law "
        "R = -a*exp(H) + b, its R² and ceiling b - a; pass@k, diversity and calibration at the last evaluation when "
        "logged) and PNG plots (entropy vs step, validation accuracy vs step, R vs H with the fitted law, "
        "reliability) from run directories holding metrics.jsonl."
    )
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output directory (default: parent of the first run)")
    parser.add_argument("--title", default="fastcov report")


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from fastcov.trainer.experiments.report import write_report

    runs = [Path(r) for r in args.runs]
    for r in runs:
        if not (r / "metrics.jsonl").is_file():
            print(f"fastcov report: {str(r)!r} has no metrics.jsonl", file=sys.stderr)
            return 2
    out = Path(args.out) if args.out else runs[0].parent
    path, _ = write_report(runs, out, args.title)
    print(path.read_text())
    print(f"written: {path}")
    return 0
