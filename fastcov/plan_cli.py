"""``fastcov plan``'s arguments and run: the per-GPU memory plan (fastcov/plan.py) of a model, a GPU count and a token
budget, the longest response that fits one GPU (``--max-response``), or a trainer config as it would run
(``--config``: the config is read by the trainer's side of the command, trainer/commands/plan.py, and handed here;
the library never imports the trainer).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fastcov.plan import (
    DEFAULT_TOKENS_PER_GPU,
    QWEN25,
    MemoryPlan,
    default_zero_stage,
    format_plan,
    load_model_shape,
    max_response,
    plan_memory,
    plan_recipe,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="YAML",
                        help="plan a trainer config (a recipe) as it would run: its model, ZeRO stage, offload, "
                             "token budget and rollout engine (then --gpus defaults to 8)")
    parser.add_argument("--model",
                        help=f"a preset ({', '.join(QWEN25)}), a Hub id (Qwen/Qwen2.5-7B; other ids from the local "
                             "Hugging Face cache, never downloaded), a model directory or config.json path, or a "
                             ".gguf file (or a directory holding one)")
    parser.add_argument("--gpus", type=int,
                        help="data-parallel GPUs sharing the ZeRO state (default 1; with --config 8)")
    parser.add_argument("--tokens-per-gpu", type=int,
                        help=f"tokens in one micro-batch per GPU (default {DEFAULT_TOKENS_PER_GPU}, "
                             "trainer.micro_token_budget's default)")
    parser.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3),
                        help="ZeRO stage (default: 0 on one GPU; on several 3, or 2 with --quantization 4bit)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    parser.add_argument("--rollout-tp", type=int, default=2, help="rollout tensor-parallel size (default 2)")
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="tokens held in the rollout KV cache per GPU (default: --tokens-per-gpu)")
    parser.add_argument("--no-checkpointing", action="store_true", help="plan without gradient checkpointing")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank, base frozen (0: off)")
    parser.add_argument("--quantization", choices=("none", "4bit"), default="none",
                        help="4bit: the frozen base's Linear layers in NF4 (QLoRA; needs --lora-rank)")
    parser.add_argument("--offload-activations", action="store_true",
                        help="checkpointed layer inputs in host memory (trainer.offload_activations)")
    parser.add_argument("--max-response", action="store_true",
                        help="the longest response that fits: one GPU's training pass over one sequence and "
                             "the HF engine's KV cache for --rollouts of them, sharing the policy's weights")
    parser.add_argument("--rollouts", type=int, default=8, help="--max-response: rollouts per prompt (default 8)")
    parser.add_argument("--prompt-len", type=int, default=512, help="--max-response: prompt tokens (default 512)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _check_args(args: argparse.Namespace) -> None:
    import math

    for flag, value in (("--gpus", args.gpus), ("--tokens-per-gpu", args.tokens_per_gpu),
                        ("--rollout-tp", args.rollout_tp)):
        if value < 1:
            raise ValueError(f"{flag}: must be >= 1, got {value}")
    if args.kv_tokens is not None and args.kv_tokens < 0:
        raise ValueError(f"--kv-tokens: must be >= 0, got {args.kv_tokens}")
    if not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        raise ValueError(f"--gpu-memory: must be a finite number of GiB > 0, got {args.gpu_memory}")


def _plan_config(args: argparse.Namespace, recipe: Any) -> MemoryPlan:
    gpus = 8 if args.gpus is None else args.gpus
    if gpus < 1:
        raise ValueError(f"--gpus: must be >= 1, got {gpus}")
    if recipe is None:  # the library never reads a trainer config: `fastcov plan` (trainer/commands/plan.py) does
        raise ValueError("--config: the trainer config must be read first; run `fastcov plan --config`")
    return plan_recipe(recipe, gpus=gpus, gpu_memory_gib=args.gpu_memory)


def _run_max_response(args: argparse.Namespace) -> int:
    if args.gpus not in (None, 1):
        raise ValueError("--max-response plans one GPU: give --gpus 1 (or leave it out)")
    if args.rollouts < 1 or args.prompt_len < 0:
        raise ValueError("--rollouts must be >= 1 and --prompt-len >= 0")
    model = load_model_shape(args.model)
    kw = {"lora_rank": args.lora_rank, "quantization": args.quantization,
          "offload_activations": args.offload_activations, "gradient_checkpointing": not args.no_checkpointing}
    best, plan = max_response(model, prompt_len=args.prompt_len, rollouts=args.rollouts,
                              gpu_memory_gib=args.gpu_memory, **kw)
    if plan is None:
        print(f"{model.name}: not even a 1-token response fits {args.gpu_memory:g} GiB")
        return 1
    if args.json:
        print(json.dumps({"max_response": best, "rollouts": args.rollouts, "prompt_len": args.prompt_len,
                          **plan.to_dict()}, indent=2))
        return 0
    print(f"longest response on one {args.gpu_memory:g} GiB GPU: {best} tokens x {args.rollouts} rollouts per "
          f"prompt ({args.prompt_len}-token prompt); the plan at that length:")
    print(format_plan(plan))
    return 0


def run(args: argparse.Namespace, recipe: Any = None) -> int:
    """``fastcov plan``'s work, ``args`` from ``add_arguments``; ``recipe``: the trainer config ``--config`` names,
    already read by the trainer's side of the command (trainer/commands/plan.py)."""
    try:
        if args.max_response:
            if args.model is None:
                raise ValueError("--max-response needs --model")
            return _run_max_response(args)
        if args.config:
            plan = _plan_config(args, recipe)
            print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
            return 0 if plan.fits() else 1
        if args.model is None:
            raise ValueError("--model is required (or plan a trainer config with --config)")
        args.gpus = 1 if args.gpus is None else args.gpus
        args.tokens_per_gpu = DEFAULT_TOKENS_PER_GPU if args.tokens_per_gpu is None else args.tokens_per_gpu
        _check_args(args)
        if args.zero is None:
            args.zero = default_zero_stage(args.gpus, args.quantization)
        model = load_model_shape(args.model)
        plan = plan_memory(model, gpus=args.gpus, tokens_per_gpu=args.tokens_per_gpu, zero_stage=args.zero,
                           gpu_memory_gib=args.gpu_memory, rollout_tp=args.rollout_tp,
                           kv_tokens_per_gpu=args.kv_tokens, gradient_checkpointing=not args.no_checkpointing,
                           lora_rank=args.lora_rank, quantization=args.quantization,
                           offload_activations=args.offload_activations)
    except ValueError as exc:
        from fastcov.errors import UsageError

        raise UsageError(str(exc)) from None
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits() else 1
