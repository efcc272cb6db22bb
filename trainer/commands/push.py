"""`fastcov push RUN_DIR --repo ID [--private] [--message MSG]`: a run's final/ to the Hugging Face Hub."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Upload a run's final/ (model and tokenizer, or a LoRA run's adapter) to a Hugging Face Hub repo, created if "
        "missing, in one commit with the run's config (fastcov_config.yaml) and a model card (README.md). The token "
        "is huggingface_hub's: HF_TOKEN or `hf auth login`; HF_ENDPOINT names another Hub."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (with final/) or a model directory")
    parser.add_argument("--repo", required=True, metavar="ID", help="the Hub repo id, namespace/name")
    parser.add_argument("--private", action="store_true", help="create the repo private (an existing one is kept)")
    parser.add_argument("--message", default=None, help="the commit message (default: fastcov: upload final)")


def run(args: argparse.Namespace) -> int:
    import logging

    from fastcov.trainer.runtime.hub import push_to_hub

    url = push_to_hub(args.run_dir, args.repo, private=True if args.private else None, commit_message=args.message)
    logging.getLogger("fastcov.push").info(f"pushed {args.run_dir} to {args.repo}: {url}")
    return 0
