"""`fastcov eval --model DIR --data FILE.parquet [--k K] [--greedy-sources]`: avg@k of a saved model, and from the
same samples pass@k / mean@k for k = 1, 2, 4, ..., K, diversity (distinct-2, distinct answers) and calibration (ECE,
Brier). With K > 1 every prompt gets K samples at --temperature; --greedy-sources keeps the papers' avg@k convention
(aime/aime25/amc sampled K times, other sources one greedy answer, so pass@k for k > 1 covers the sampled ones only)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "avg@k accuracy of a Hugging Face model directory (a run's final/ export, or any causal LM) on "
        "verl-style parquet. Data sources aime/aime25/amc are sampled at --temperature, others greedily."
    )
    parser.add_argument("--model", required=True, help="model directory or hub path (with its tokenizer)")
    parser.add_argument("--data", required=True, nargs="+", help="parquet file(s)")
    parser.add_argument("--k", type=int, default=1,
                        help="samples per prompt: pass@k and mean@k for k = 1, 2, 4, ..., K (K > 1 samples every "
                             "data source at --temperature, unless --greedy-sources)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-len", type=int, default=2048)
    parser.add_argument("--max-prompts", type=int, default=0, help="evaluate at most this many prompts (0 = all)")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per generation batch")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--sample-all", action="store_true",
                        help="sample --k responses at --temperature for every data source (the default when --k > 1; "
                             "with --k 1 it samples the greedy sources too)")
    parser.add_argument("--greedy-sources", action="store_true",
                        help="the avg@k convention: only aime/aime25/amc are sampled --k times, other sources get one "
                             "greedy answer (their pass@k is reported for k = 1 only)")
    parser.add_argument("--task", default="math",
                        help="a reward task (fastcov.trainer.rewards.REWARD_TASKS): math, the last \\boxed{} answer; "
                             "code, the last code block runs against the row's tests in the sandbox")
    parser.add_argument("--reliability-plot", default=None, metavar="PNG",
                        help="write the reliability diagram (accuracy vs confidence) to this file")


def run(args: argparse.Namespace) -> int:
    import json
    import math
    import sys
    from pathlib import Path

    from fastcov.errors import UsageError, one_line
    from fastcov.trainer.config import ModelConfig
    from fastcov.trainer.evaluation import evaluate_model
    from fastcov.trainer.rewards import REWARD_TASKS
    from fastcov.trainer.runtime.model import check_model_source

    if args.k < 1:
        print("fastcov eval: --k must be >= 1", file=sys.stderr)
        return 2
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise UsageError(f"--temperature: must be a finite number > 0, got {args.temperature}")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--max-prompt-len", args.max_prompt_len),
                        ("--batch-size", args.batch_size)):
        if value < 1:
            raise UsageError(f"{flag}: must be >= 1, got {value}")
    if args.max_prompts < 0:
        raise UsageError(f"--max-prompts: must be >= 0 (0 = all), got {args.max_prompts}")
    if args.sample_all and args.greedy_sources:
        raise UsageError("--sample-all and --greedy-sources contradict each other; give one")
    sample_all = args.sample_all or (args.k > 1 and not args.greedy_sources)  # --k 4 means pass@4 on every prompt
    if args.task not in REWARD_TASKS:
        raise UsageError(f"--task: unknown reward task {args.task!r}; registered: {', '.join(REWARD_TASKS.names())}")
    check_model_source(ModelConfig(path=args.model), names=("--model", "--model"), adapters_ok=True)
    for f in args.data:
        if not Path(f).is_file():
            raise UsageError(f"--data: {f!r} does not exist or is not a file")
    try:
        res = evaluate_model(args.model, args.data, k=args.k, temperature=args.temperature,
                             max_new_tokens=args.max_new_tokens, max_prompt_len=args.max_prompt_len,
                             max_prompts=args.max_prompts, batch_size=args.batch_size, device=args.device,
                             seed=args.seed, sample_all=sample_all, task=args.task)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fastcov eval: {one_line(exc)}", file=sys.stderr)
        return 2
    bins = res.pop("val_calibration_bins", None)
    if args.reliability_plot and bins:
        from fastcov.metrics import CalibrationBin, reliability_plot

        m = len(bins)
        reliability_plot({Path(args.model).name: [
            CalibrationBin(i / m, (i + 1) / m, int(b[0]), b[1] if b[1] is not None else math.nan,
                           b[2] if b[2] is not None else math.nan) for i, b in enumerate(bins)]},
            args.reliability_plot)
        res["reliability_plot"] = args.reliability_plot
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0
