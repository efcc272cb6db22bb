"""``fastcov fit-law METRICS.jsonl``: fit the entropy law R = −a·exp(H) + b to a training log.

The metrics file holds one JSON object per line (one per step, in step order). Rows without the
``--y`` key (or with it null) are skipped, as are rows without ``--x`` — e.g. ``val_acc`` is only
logged on evaluation steps. Blank lines are ignored. Prints a, b, R², ceiling and the hold-out RMSE;
``--plot`` saves a figure, ``--json`` writes the numbers.

A torn last line (a run killed mid-write: no newline, not JSON) is skipped with a note; any other bad
line stops with its line number.

Exit status: 0 on success, 2 on a bad file, argument or an impossible fit (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

__all__ = ["add_arguments", "run", "read_metrics"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", metavar="METRICS.jsonl", help="JSON-lines metrics file, one object per step")
    parser.add_argument("--x", default="entropy", help="key of the entropy column (default: entropy)")
    parser.add_argument("--y", default="val_acc", help="key of the reward/accuracy column (default: val_acc)")
    parser.add_argument("--fit-fraction", type=float, default=1.0,
                        help="fit on this leading fraction of the points, report RMSE on the rest (default 1.0)")
    parser.add_argument("--plot", metavar="PNG", default=None, help="save a plot of the fit here")
    parser.add_argument("--json", metavar="OUT.json", default=None, help="write the fitted numbers here")


def read_metrics(path: str | Path, x_key: str, y_key: str) -> tuple[list[float], list[float], int]:
    """Read (x, y) pairs from a JSON-lines file, in file order.

    Returns:
        (xs, ys, skipped): the values of the rows that have both keys non-null, and how many
        non-blank rows were skipped for lacking one.

    Raises:
        ValueError: a line that is not a JSON object, or a value that is not a number (message gives
            the line number and key).
    """
    xs: list[float] = []
    ys: list[float] = []
    skipped = 0
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    torn_possible = lines[-1] != ""  # no newline after the last line: a write was cut short
    for lineno, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if torn_possible and lineno == len(lines):
                skipped += 1  # the torn last line of a killed run
                continue
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        if row.get(x_key) is None or row.get(y_key) is None:
            skipped += 1
            continue
        pair = []
        for key in (x_key, y_key):
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{path}:{lineno}: {key!r} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{path}:{lineno}: {key!r} must be finite, got {value!r}")
            pair.append(float(value))
        xs.append(pair[0])
        ys.append(pair[1])
    return xs, ys, skipped


def run(args: argparse.Namespace) -> int:
    from fastcov.errors import UsageError
    from fastcov.law import fit_entropy_law

    prog = "fastcov fit-law"
    if not (math.isfinite(args.fit_fraction) and 0 < args.fit_fraction <= 1):
        raise UsageError(f"--fit-fraction: must be in (0, 1], got {args.fit_fraction}")
    for flag, out in (("--plot", args.plot), ("--json", args.json)):
        if out and not Path(out).resolve().parent.is_dir():
            raise UsageError(f"{flag}: the folder of {out!r} does not exist; create it first")
    try:
        xs, ys, skipped = read_metrics(args.metrics, args.x, args.y)
    except FileNotFoundError:
        print(f"{prog}: no such file: {args.metrics}", file=sys.stderr)
        return 2
    except UnicodeDecodeError:
        raise UsageError(f"{args.metrics}: not a UTF-8 JSON-lines file") from None
    except OSError as exc:
        raise UsageError(f"cannot read {args.metrics!r} ({exc.strerror or exc})") from None
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if not xs:
        print(f"{prog}: no row of {args.metrics} has both {args.x!r} and {args.y!r}", file=sys.stderr)
        return 2
    try:
        law = fit_entropy_law(xs, ys, fit_fraction=args.fit_fraction)
    except ValueError as exc:
        print(f"{prog}: cannot fit {args.y!r} (reward) on {args.x!r} (entropy): {exc}", file=sys.stderr)
        return 2

    print(f"{args.metrics}: {len(xs)} points with {args.x!r} and {args.y!r} ({skipped} rows skipped)")
    print(law.summary())
    if args.plot:
        law.plot(args.plot, xlabel=f"{args.x} H", ylabel=args.y, title=f"{args.y} = -a*exp({args.x}) + b")
        print(f"plot: {args.plot}")
    if args.json:
        out = law.to_dict()
        out.update(x=args.x, y=args.y, metrics=str(args.metrics), skipped_rows=skipped)
        out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"json: {args.json}")
    return 0
