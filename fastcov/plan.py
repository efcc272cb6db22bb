"""Per-GPU memory plan for RL training: parameters, gradients, optimizer states, activations, logits
(naive vs fused) and the rollout KV cache, for a model, a GPU count, a token budget and a ZeRO stage.

Estimates, in bytes, from the model shape alone (mixed precision: bf16 parameters and gradients, fp32
master weights and two Adam moments). `fastcov plan --help` for the command.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer (Qwen2/Llama style, GQA, SwiGLU MLP)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv + ((h + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h  # two RMSNorm weights
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "custom") -> "ModelShape":
        """From a Hugging Face config.json dict (Qwen2, Llama, Mistral keys)."""
        try:
            return cls(
                name=name,
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=int(config["num_attention_heads"]),
                num_kv_heads=int(config.get("num_key_value_heads", config["num_attention_heads"])),
                vocab_size=int(config["vocab_size"]),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            )
        except KeyError as exc:
            raise ValueError(f"model config lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model config has a non-integer size ({exc})") from None


# Published Qwen2.5 architectures (config.json of each checkpoint).
QWEN25 = {
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": ModelShape("qwen2.5-3b", 2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": ModelShape("qwen2.5-14b", 5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": ModelShape("qwen2.5-32b", 5120, 27648, 64, 40, 8, 152064, False),
    "qwen2.5-72b": ModelShape("qwen2.5-72b", 8192, 29568, 80, 64, 8, 152064, False),
}


@dataclass
class MemoryPlan:
    model: str
    num_parameters: int
    gpus: int
    zero_stage: int
    tokens_per_gpu: int
    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    logits_naive: float
    logits_fused: float
    rollout_weights: float
    rollout_kv_cache: float
    gpu_memory: float

    @property
    def training_total(self) -> float:
        """Training-time peak with the fused kernel (rollout memory is released by sleep mode)."""
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.logits_fused

    @property
    def training_total_naive(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.logits_naive

    @property
    def rollout_total(self) -> float:
        return self.rollout_weights + self.rollout_kv_cache

    def fits(self, naive: bool = False) -> bool:
        train = self.training_total_naive if naive else self.training_total
        return max(train, self.rollout_total) <= self.gpu_memory

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(training_total=self.training_total, training_total_naive=self.training_total_naive,
                   rollout_total=self.rollout_total, fits=self.fits(), fits_naive=self.fits(naive=True))
        return out


def plan_memory(model: ModelShape, *, gpus: int, tokens_per_gpu: int, zero_stage: int = 3,
                gpu_memory_gib: float = 80.0, rollout_tp: int = 2, kv_tokens_per_gpu: int | None = None,
                gradient_checkpointing: bool = True) -> MemoryPlan:
    """Per-GPU bytes of each part of a colocated RL step.

    ZeRO stage s shards the fp32 optimizer states (12 bytes/parameter: master, m, v) for s ≥ 1, the bf16
    gradients (2 bytes) for s ≥ 2 and the bf16 parameters (2 bytes) for s = 3 over `gpus`.
    Activations with checkpointing: each layer's bf16 input (T·H·2) plus one layer recomputed
    (T·(10·H + 4·I)·2: q/k/v/o, norms, residuals and the SwiGLU intermediates; attention by SDPA/flash,
    no T² term). Without checkpointing, every layer's working set is kept.
    Logits, naive: bf16 logits, their fp32 copy and fp32 log-softmax, T·V·(2 + 4 + 4). Fused
    (fastcov's Triton path): O(T) statistics, the fp32 dh accumulator T·H·4 and the fp32 dW
    accumulator V·H·4. Rollout: bf16 weights split over `rollout_tp` GPUs and a bf16 KV cache of
    2·L·kv_heads·head_dim·2 bytes per token for `kv_tokens_per_gpu` tokens (default: tokens_per_gpu).
    """
    if model is None:
        raise ValueError("model is required")
    for name, value in (("gpus", gpus), ("tokens_per_gpu", tokens_per_gpu), ("rollout_tp", rollout_tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not gpu_memory_gib > 0:
        raise ValueError(f"gpu_memory_gib must be > 0, got {gpu_memory_gib!r}")
    psi = model.num_parameters()
    t, h, i, v, layers = tokens_per_gpu, model.hidden_size, model.intermediate_size, model.vocab_size, model.num_layers
    parameters = 2 * psi / (gpus if zero_stage == 3 else 1)
    gradients = 2 * psi / (gpus if zero_stage >= 2 else 1)
    optimizer = 12 * psi / (gpus if zero_stage >= 1 else 1)
    layer_working_set = t * (10 * h + 4 * i) * 2
    if gradient_checkpointing:
        activations = layers * t * h * 2 + layer_working_set
    else:
        activations = layers * layer_working_set
    logits_naive = t * v * (2 + 4 + 4)
    logits_fused = t * 4 * 4 + t * h * 4 + v * h * 4
    kv_tokens = tokens_per_gpu if kv_tokens_per_gpu is None else kv_tokens_per_gpu
    kv_per_token = 2 * layers * model.num_kv_heads * model.head_dim * 2
    return MemoryPlan(
        model=model.name, num_parameters=psi, gpus=gpus, zero_stage=zero_stage, tokens_per_gpu=t,
        parameters=parameters, gradients=gradients, optimizer_states=optimizer, activations=activations,
        logits_naive=logits_naive, logits_fused=logits_fused,
        rollout_weights=2 * psi / rollout_tp, rollout_kv_cache=kv_tokens * kv_per_token,
        gpu_memory=gpu_memory_gib * GIB,
    )


def format_plan(plan: MemoryPlan) -> str:
    gib = lambda x: f"{x / GIB:9.2f} GiB"  # noqa: E731
    rows = [
        ("parameters (bf16)", plan.parameters),
        ("gradients (bf16)", plan.gradients),
        ("optimizer states (fp32 master + Adam)", plan.optimizer_states),
        ("activations (checkpointed)", plan.activations),
        ("logits, fused (fastcov)", plan.logits_fused),
        ("logits, naive (materialized)", plan.logits_naive),
        ("training total, fused", plan.training_total),
        ("training total, naive", plan.training_total_naive),
        ("rollout weights (bf16, / TP)", plan.rollout_weights),
        ("rollout KV cache (bf16)", plan.rollout_kv_cache),
        ("rollout total", plan.rollout_total),
    ]
    lines = [
        f"{plan.model}: {plan.num_parameters / 1e9:.2f}B parameters, {plan.gpus} GPUs, ZeRO-{plan.zero_stage}, "
        f"{plan.tokens_per_gpu} tokens per GPU",
        "per GPU:",
    ]
    lines += [f"  {name:<40s}{gib(value)}" for name, value in rows]
    verdict = lambda ok: "fits" if ok else "does NOT fit"  # noqa: E731
    lines.append(f"GPU memory {plan.gpu_memory / GIB:.0f} GiB: fused {verdict(plan.fits())}, "
                 f"naive {verdict(plan.fits(naive=True))}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"a preset ({', '.join(QWEN25)}) or the path of a Hugging Face config.json")
    parser.add_argument("--gpus", type=int, required=True, help="data-parallel GPUs sharing the ZeRO state")
    parser.add_argument("--tokens-per-gpu", type=int, required=True, help="tokens in one micro-batch per GPU")
    parser.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage (default 3)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    parser.add_argument("--rollout-tp", type=int, default=2, help="rollout tensor-parallel size (default 2)")
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="tokens held in the rollout KV cache per GPU (default: --tokens-per-gpu)")
    parser.add_argument("--no-checkpointing", action="store_true", help="plan without gradient checkpointing")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def load_model_shape(spec: str) -> ModelShape:
    if spec.lower() in QWEN25:
        return QWEN25[spec.lower()]
    if spec.endswith(".json") or "/" in spec:
        path = spec if spec.endswith(".json") else f"{spec.rstrip('/')}/config.json"
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"--model: no such config file {path!r}") from None
        except OSError as exc:
            raise ValueError(f"--model: cannot read {path!r} ({exc.strerror or exc})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"--model: {path!r} is not valid JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(config, dict):
            raise ValueError(f"--model: {path!r} must hold a JSON object (a Hugging Face config.json)")
        try:
            return ModelShape.from_hf_config(config, name=spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--model: {path!r}: {exc}") from None
    raise ValueError(f"--model: unknown preset {spec!r}; presets are {', '.join(QWEN25)} or a config.json path")


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


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        model = load_model_shape(args.model)
        plan = plan_memory(model, gpus=args.gpus, tokens_per_gpu=args.tokens_per_gpu, zero_stage=args.zero,
                           gpu_memory_gib=args.gpu_memory, rollout_tp=args.rollout_tp,
                           kv_tokens_per_gpu=args.kv_tokens, gradient_checkpointing=not args.no_checkpointing)
    except ValueError as exc:
        from fastcov.cli import UsageError

        raise UsageError(str(exc)) from None
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits() else 1

