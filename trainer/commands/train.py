"""`fastcov train CONFIG [key=value ...] [--resume [CHECKPOINT]]`, flags and overrides in any order."""

from __future__ import annotations

import argparse
import re

# a dotted override (`trainer.max_steps=6`): what `--resume` must not take for its CHECKPOINT
OVERRIDE = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*=")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train a policy with GRPO-family advantages and a vanilla / Clip-Cov / KL-Cov loss. "
        "Example: fastcov train configs/demo.yaml algo.mode=kl_cov trainer.max_steps=50"
    )
    parser.add_argument("config", help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, values parsed as YAML (algo.mode=clip_cov optim.lr=1e-5)")
    parser.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                        help="resume from the newest checkpoint of the run (or the given checkpoint directory)")
    parser.add_argument("--overwrite", action="store_true",
                        help="trainer.run_dir already holds a run: move it aside (<run_dir>.old-<time>) and start "
                             "afresh (nothing is deleted)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment is what counts.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def resume_target(args: argparse.Namespace) -> None:
    """`--resume trainer.max_steps=6`: argparse gives the override to --resume as its CHECKPOINT; give it back
    (a path that exists stays a checkpoint, whatever its name)."""
    from pathlib import Path

    if isinstance(args.resume, str) and OVERRIDE.match(args.resume) and not Path(args.resume).exists():
        args.overrides.append(args.resume)
        args.resume = True


def run(args: argparse.Namespace) -> int:
    import sys

    from fastcov.trainer.config import load_config

    resume_target(args)
    cfg = load_config(args.config, args.overrides)  # a ConfigError is one line from fastcov.cli.main
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    import logging

    from fastcov.trainer.runtime.errors import LostRankError, RolloutError
    from fastcov.trainer.train import train

    if logging.getLogger("fastcov").getEffectiveLevel() > logging.INFO:
        cfg.trainer.progress = False  # --quiet: no progress bar either

    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite)
    except RolloutError as exc:
        print(f"fastcov train: {exc}", file=sys.stderr)
        return 1
    except LostRankError as exc:
        import os

        print(f"fastcov train: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # out without the interpreter's teardown: with a peer gone, the process group's threads can abort it
        # (SIGABRT, 'terminate called without an active exception') after the line is out
        os._exit(exc.exit_code)
    except KeyboardInterrupt:
        print("fastcov train: aborted without saving (second Ctrl-C)", file=sys.stderr)
        return 130
    return 0
