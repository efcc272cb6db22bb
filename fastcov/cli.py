"""The `fastcov` command. Each subcommand lives in the module that owns it; this file only dispatches.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported
only when their subcommand runs, so `fastcov fit-law --help` never imports deepspeed or transformers.

Errors: a mistake of the user's (a bad argument, a missing or malformed file, a bad config value) is
raised anywhere below as a ``UserError`` and printed here as one line on stderr, ``fastcov CMD: what is
wrong and what to do``, exit status ``UserError.exit_code`` (2 by default). Anything else is a bug and
keeps its traceback. ``--debug`` (anywhere on the command line) or ``FASTCOV_DEBUG=1`` re-raises user
errors too, with their traceback. Exit codes are listed in docs/reliability.md.

Flags and ``KEY=VALUE`` overrides may come in any order (argparse's intermixed parsing), and ``--version``
prints the installed version. ``--quiet`` / ``--verbose`` (anywhere) set the level of fastcov's own messages
(fastcov/log.py): warnings and errors only / debug messages too; ``--quiet`` also hides the training progress
bar. ``python -m fastcov`` is the same command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from fastcov.errors import UsageError, UserError, one_line

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("fastcov.trainer.commands.train", "train a policy with GRPO/DAPO and Clip-Cov/KL-Cov"),
    "eval": ("fastcov.trainer.commands.eval", "evaluate a checkpoint (avg@k, pass@k, diversity, calibration)"),
    "report": ("fastcov.trainer.commands.report", "write report.md and plots from run directories"),
    "fit-law": ("fastcov.law_cli", "fit the entropy law R = -a*exp(H) + b to a metrics.jsonl"),
    "plan": ("fastcov.trainer.commands.plan", "per-GPU memory plan for a model, GPU count and token budget"),
    "push": ("fastcov.trainer.commands.push", "upload a run's final model to the Hugging Face Hub"),
}


def debug_enabled() -> bool:
    return os.environ.get("FASTCOV_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _version() -> str:
    from fastcov import __version__

    return __version__


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the argument (and --help), not usage + error."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _take_flag(argv: list[str], flag: str) -> tuple[list[str], bool]:
    """``argv`` without ``flag`` (accepted anywhere on the command line), and whether it was there."""
    rest = [a for a in argv if a != flag]
    return rest, len(rest) != len(argv)


def _take_verbosity(argv: list[str]) -> list[str]:
    """--quiet (warnings and errors only) / --verbose (debug messages too), anywhere: fastcov's log level
    (fastcov/log.py), in this process and those it starts."""
    from fastcov.log import set_verbosity

    argv, quiet = _take_flag(argv, "--quiet")
    argv, verbose = _take_flag(argv, "--verbose")
    if quiet and verbose:
        raise UsageError("--quiet and --verbose contradict each other; give one")
    if quiet or verbose:
        set_verbosity("WARNING" if quiet else "DEBUG")
    return argv


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
    argv, debug = _take_flag(argv, "--debug")
    debug = debug or debug_enabled()
    try:
        argv = _take_verbosity(argv)
    except UserError as exc:
        print(f"fastcov: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    parser = _Parser(prog="fastcov", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    parser.add_argument("--version", action="version", version=f"fastcov {_version()}")
    parser.add_argument("--quiet", action="store_true", help="only warnings and errors (anywhere on the line)")
    parser.add_argument("--verbose", action="store_true", help="debug messages too (anywhere on the line)")
    parser.add_argument("--debug", action="store_true", help="tracebacks for user errors too (FASTCOV_DEBUG=1)")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "--version":
        print(f"fastcov {_version()}")
        return 0
    name = argv[0]
    prog = f"fastcov {name}" if name in SUBCOMMANDS else "fastcov"
    try:
        if name not in SUBCOMMANDS:
            raise UsageError(f"unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}")
        module_name, help_text = SUBCOMMANDS[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                raise UsageError("not available in this version") from exc
            raise
        sub_parser = _Parser(prog=prog, description=help_text)
        module.add_arguments(sub_parser)
        # flags anywhere among the positionals (`fastcov train CONFIG --overwrite trainer.max_steps=6`)
        args = sub_parser.parse_intermixed_args(argv[1:])
        return int(module.run(args) or 0)
    except UserError as exc:
        if debug:
            raise
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:  # a dependency of the `train` extra (yaml, deepspeed, transformers...)
        if debug or not exc.name or exc.name.split(".")[0] == "fastcov":
            raise
        print(f"{prog}: needs the 'train' extra (no module named {exc.name!r}): pip install 'fastcov[train]'",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m fastcov.cli` (the deepspeed/torchrun launchers): run the importable module's main, so
    # that the UserError raised below is the class this handler catches, not a __main__ copy of it.
    from fastcov.cli import main as _main

    raise SystemExit(_main())
