"""``python -m bench.gpu_suite``'s command line: the parts by name, each run under its cap and guarded (what
it raises is a row), then the summary."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.gpu_suite.kernel_parts import part_correctness, part_kernels, part_pytest
from bench.gpu_suite.presets import BAD_STATUSES, NEEDS_WHOLE_CAP, PARTS_ORDER, RUN_ORDER, SIZE_ALIASES
from bench.gpu_suite.render import print_table, write_md
from bench.gpu_suite.runner import Suite, env_summary, environment, guarded, log, make_suite
from bench.gpu_suite.train_parts import part_extra, part_memory, part_train, part_trainer, part_vllm

# the --help line (the package docstring's first)
DESCRIPTION = ("One entry point for the GPU validation run: kernel correctness, the kernel benchmark, a training "
               "step, pytest.")

# =========================================================================== running parts, output


PARTS = {"correctness": part_correctness, "kernels": part_kernels, "train": part_train, "pytest": part_pytest,
         "extra": part_extra, "vllm": part_vllm, "trainer": part_trainer, "memory": part_memory}


class InjectedCrash(RuntimeError):
    """The rehearsal's ``--fault PART=crash``: the part raises at its start."""


def _crash(s: Suite) -> None:
    raise InjectedCrash(f"injected crash of part {s.part}")


def run_part(s: Suite, part: str) -> None:
    """One part under its cap; ``not reached`` when the budget cannot start it (for ``extra``: its whole cap)."""
    cap = s.caps.get(part, float("inf"))
    need = cap if part in NEEDS_WHOLE_CAP else min(cap, 30.0 if s.size != "rehearse" else 5.0)
    if s.left() - s.reserve < need:
        s.record(part, "part", "not reached", f"{s.left():.0f} s of the run's --budget left, the part needs "
                 f"{need:.0f} s" + (" (it runs only when its whole cap is left)" if part in NEEDS_WHOLE_CAP else ""))
    else:
        log(f"part {part} (size {s.size}, cap {cap:.0f} s, {s.left():.0f} s of the budget left)")
        s.part, s.part_deadline = part, time.monotonic() + cap
        t0 = time.monotonic()
        try:
            guarded(s, part, "part", _crash if s.faults.get(part) == "crash" else PARTS[part])
        finally:
            s.part, s.part_deadline = None, None
        s.record(part, "part time", "info", summary=f"{time.monotonic() - t0:.0f} s of a {cap:.0f} s cap",
                 wall_s=time.monotonic() - t0, cap_s=cap)
    write_md(s.path)


# =========================================================================== CLI


def _part_seconds(text: str) -> tuple[str, float]:
    part, _, secs = text.partition("=")
    if part not in PARTS_ORDER:
        raise argparse.ArgumentTypeError(f"unknown part {part!r} (parts: {', '.join(PARTS_ORDER)})")
    try:
        return part, float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cap {text!r}: seconds must be a number (PART=SECONDS)") from None


def _part_fault(text: str) -> tuple[str, str]:
    part, _, kind = text.partition("=")
    if part not in PARTS_ORDER or kind not in ("crash", "hang"):
        raise argparse.ArgumentTypeError(f"--fault {text!r}: PART=crash or PART=hang, PART one of "
                                         f"{', '.join(PARTS_ORDER)}")
    return part, kind


def parse_parts(text: str) -> list[str]:
    """``correctness,kernels`` -> the parts in the order given; ``all`` -> RUN_ORDER."""
    if text == "all":
        return list(RUN_ORDER)
    parts = [x for x in text.replace(" ", ",").split(",") if x]
    unknown = [x for x in parts if x not in PARTS_ORDER]
    if unknown or not parts:
        raise ValueError(f"unknown part {unknown[0]!r}" if unknown else "no part named")
    return list(dict.fromkeys(parts))


def record_setup(s: Suite, path: Path) -> None:
    """gpu_run.sh's setup steps (wheels, install), one ``status<TAB>name<TAB>message`` line each, as rows."""
    if not path.is_file():
        s.record("setup", "setup log", "error", f"no setup log at {path}")
        return
    for line in path.read_text().splitlines():
        status, _, rest = line.partition("\t")
        name, _, message = rest.partition("\t")
        if status:
            s.record("setup", name or "step", status, message if status != "ok" else "", message if status == "ok"
                     else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_suite", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=[*PARTS_ORDER, "all"], help="one part (all: correctness, kernels, train, "
                   "pytest, extra in turn)")
    p.add_argument("--parts", help=f"parts in the order to run them, comma-separated ({', '.join(PARTS_ORDER)}) "
                   "or all")
    p.add_argument("--out", default="bench/results", help="results folder (default bench/results; on the "
                   "device machine $OUT)")
    p.add_argument("--flat", action="store_true", help="write <out>/run.jsonl, run.md, kernels.jsonl, kernels.md "
                   "and nothing else under <out> (the device call returns at most 8 files)")
    p.add_argument("--size", choices=sorted(SIZE_ALIASES), default="full",
                   help="full (= 1.5b, the GPU run), smoke (= tiny: toy sizes, CPU too) or rehearse (gpu_run.sh "
                   "--rehearse: toy sizes on CPU, the Triton path under the interpreter)")
    p.add_argument("--steps", type=int, default=3, help="training steps, the first one a warm-up (default 3)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds per subprocess (default 540)")
    p.add_argument("--budget", type=float, default=570.0,
                   help="seconds for the whole invocation, summary included (default 570; 0: no limit)")
    p.add_argument("--cap", type=_part_seconds, action="append", metavar="PART=SECONDS",
                   help="a part's time cap, replacing PART_CAPS[size] (repeatable)")
    p.add_argument("--fault", type=_part_fault, action="append", metavar="PART=crash|hang",
                   help="rehearsal only: make a part raise at its start, or its subprocess hang until stopped")
    p.add_argument("--setup", metavar="TSV", help="gpu_run.sh's setup log: recorded as setup rows")
    p.add_argument("--render", metavar="JSONL", help="only write the markdown of a suite .jsonl (next to it)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    args = p.parse_args(argv)
    if args.render:
        print(write_md(Path(args.render)))
        return 0
    if bool(args.part) == bool(args.parts):
        p.error("name the parts: --part PART or --parts A,B,... (or --render)")
    try:
        parts = parse_parts(args.parts) if args.parts else parse_parts(args.part)
    except ValueError as exc:
        p.error(f"--parts: {exc} (parts: {', '.join(PARTS_ORDER)})")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.fault and SIZE_ALIASES[args.size] != "rehearse":
        p.error("--fault is for the rehearsal only (--size rehearse)")
    s = make_suite(args)
    env = environment(s, argv)
    s.record("env", "environment", "ok", summary=env_summary(env), **env)
    if args.setup:
        record_setup(s, Path(args.setup))
    for part in parts:
        run_part(s, part)
    print(f"rows: {s.path}\nsummary: {s.path.with_suffix('.md')}")
    print_table(s.rows)
    return 1 if any(r["status"] in BAD_STATUSES for r in s.rows) else 0
