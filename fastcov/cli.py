"""The `fastcov` command. Each subcommand lives in the module that owns it; this file only dispatches.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported
only when their subcommand runs, so `fastcov fit-law --help` never imports deepspeed or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("fastcov.trainer.cli_train", "train a policy with GRPO/DAPO and Clip-Cov/KL-Cov"),
    "eval": ("fastcov.trainer.cli_eval", "evaluate a checkpoint (avg@k on a parquet dataset)"),
    "report": ("fastcov.trainer.cli_report", "write report.md and plots from run directories"),
    "fit-law": ("fastcov.law_cli", "fit the entropy law R = -a*exp(H) + b to a metrics.jsonl"),
    "plan": ("fastcov.plan", "per-GPU memory plan for a model, GPU count and token budget"),
}


def _take_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher puts --local_rank=N before the subcommand; move it into LOCAL_RANK."""
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            rest.append(arg)
        i += 1
    return rest


def main(argv: list[str] | None = None) -> int:
    argv = _take_local_rank(sys.argv[1:] if argv is None else list(argv))
    parser = argparse.ArgumentParser(prog="fastcov", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    name = argv[0]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    module_name, help_text = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            print(f"fastcov {name}: not available in this version", file=sys.stderr)
            return 2
        raise
    sub_parser = argparse.ArgumentParser(prog=f"fastcov {name}", description=help_text)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
