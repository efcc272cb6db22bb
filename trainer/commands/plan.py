"""`fastcov plan`: the per-GPU memory planner's command (fastcov/plan_cli.py), which needs no trainer. With ``--config``
the trainer config is read here and handed to the planner: the trainer calls the library, the library never reads
the trainer's config (docs/design.md §8)."""

from __future__ import annotations

import argparse

from fastcov import plan_cli
from fastcov.errors import ConfigError, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    plan_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    recipe = None
    if args.config and not args.max_response:
        from fastcov.trainer.config import load_config

        try:
            recipe = load_config(args.config, [])
        except ConfigError as exc:
            raise UsageError(f"--config: {exc}") from None
    return plan_cli.run(args, recipe=recipe)
