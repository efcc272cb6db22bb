"""Per-GPU memory plan for RL training: parameters, gradients, optimizer states, activations, logits (naive vs fused)
and the rollout KV cache, for a model, a GPU count, a token budget and a ZeRO stage. Estimates, in bytes, from the
model shape alone (mixed precision: bf16 parameters and gradients, fp32 master weights and two Adam moments).
The command, `fastcov plan --help`, is fastcov/plan_cli.py."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1024**3


# model.lora_targets' default (the trainer's config repeats it): attention and MLP projections.
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# NF4: 4 bits per weight plus one fp32 absmax per 64-weight block (bitsandbytes' default block size).
NF4_BYTES = 0.5 + 4 / 64


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

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each Linear of one decoder layer, by its Qwen2/Llama module name."""
        h, kv, i = self.hidden_size, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_parameters(self, rank: int, targets: tuple[str, ...] = LORA_PROJECTIONS) -> int:
        """Adapter parameters of rank ``rank`` on ``targets``: r·(in + out) per adapted Linear."""
        shapes = self.projections()
        return self.num_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)

    def linear_parameters(self) -> int:
        """Weights of the decoder's Linear layers (what NF4 quantizes; embeddings, head and norms stay)."""
        return self.num_layers * sum(a * b for a, b in self.projections().values())

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "custom") -> ModelShape:
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
    zero3_gathered: float = 0.0  # ZeRO-3: the gathered LM head and its full gradient, while the head runs
    rollout_during_training: float = 0.0  # what the rollout engine keeps while the policy trains
    host_optimizer_states: float = 0.0  # ZeRO-Offload: the optimizer states in host memory, per rank
    rollout_engine: str = "separate"  # vllm | hf-shared | hf-copy | separate (the plain model-level plan)
    trainable_parameters: int = 0  # LoRA: the adapters; else every parameter
    host_activations: float = 0.0  # trainer.offload_activations: the checkpointed layer inputs, in host memory

    @property
    def training_resident(self) -> float:
        """What the policy keeps on the GPU at all times: its parameters, gradients and optimizer states."""
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def training_total(self) -> float:
        """Training-time peak with the fused kernel (plus what the rollout engine keeps meanwhile)."""
        return (self.training_resident + self.activations + self.logits_fused + self.zero3_gathered
                + self.rollout_during_training)

    @property
    def training_total_naive(self) -> float:
        return (self.training_resident + self.activations + self.logits_naive + self.zero3_gathered
                + self.rollout_during_training)

    @property
    def rollout_total(self) -> float:
        """Rollout-time peak: the rollout engine, plus the policy's resident state when they share the GPU."""
        engine = self.rollout_weights + self.rollout_kv_cache
        return engine if self.rollout_engine == "separate" else engine + self.training_resident

    def fits(self, naive: bool = False) -> bool:
        train = self.training_total_naive if naive else self.training_total
        return max(train, self.rollout_total) <= self.gpu_memory

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(training_total=self.training_total, training_total_naive=self.training_total_naive,
                   rollout_total=self.rollout_total, peak=max(self.training_total, self.rollout_total),
                   fits=self.fits(), fits_naive=self.fits(naive=True))
        return out


def plan_memory(model: ModelShape, *, gpus: int, tokens_per_gpu: int, zero_stage: int = 3,
                gpu_memory_gib: float = 80.0, rollout_tp: int = 2, kv_tokens_per_gpu: int | None = None,
                gradient_checkpointing: bool = True, offload_optimizer: bool = False,
                workspace_mb: float = 256.0, lora_rank: int = 0, quantization: str = "none",
                offload_activations: bool = False, precision: str = "bf16") -> MemoryPlan:
    """Per-GPU bytes of each part of a colocated RL step.

    ZeRO stage s shards the fp32 optimizer states (12 bytes/parameter: master, m, v) for s ≥ 1, the bf16
    gradients (2 bytes) for s ≥ 2 and the bf16 parameters (2 bytes) for s = 3 over `gpus`; with
    `offload_optimizer` the optimizer states sit in host memory instead. Under ZeRO-3 the LM head is
    gathered while it runs, with its full gradient before the reduce-scatter: 2·V·H·2 bytes.
    Activations with checkpointing: each layer's bf16 input (T·H·2) plus one layer recomputed
    (T·(10·H + 4·I)·2: q/k/v/o, norms, residuals and the SwiGLU intermediates; attention by SDPA/flash,
    no T² term). Without checkpointing, every layer's working set is kept.
    Logits, naive: bf16 logits, their fp32 copy and fp32 log-softmax, T·V·(2 + 4 + 4). Fused
    (fastcov): O(T) statistics (4 fp32 per token) and the backward's dZ workspace, min(budget, T·V·2)
    (docs/kernels.md). Rollout: bf16 weights split over `rollout_tp` GPUs and a bf16 KV cache of
    2·L·kv_heads·head_dim·2 bytes per token for `kv_tokens_per_gpu` tokens (default: tokens_per_gpu).
    LoRA (`lora_rank` > 0): the base is frozen (bf16, or NF4 for its decoder Linears with `quantization`
    "4bit": ``NF4_BYTES`` per weight), only the adapters (r·(in + out) per projection) have gradients
    and optimizer states; the recomputed layer also holds the adapters' T·r intermediates.
    `offload_activations`: the checkpointed layer inputs live in host memory; the GPU holds two (the one
    in use and the one in flight). `precision` "fp32" (the trainer on a CPU): 4 bytes wherever bf16 has 2,
    and Adam's m and v only (8 bytes per trainable parameter: the fp32 parameters are the master weights).
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
    if offload_optimizer and zero_stage < 1:
        raise ValueError("offload_optimizer needs zero_stage >= 1")
    _check_lora(lora_rank, quantization, zero_stage, offload_activations, gradient_checkpointing)
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    b = 2 if precision == "bf16" else 4  # bytes of a parameter, gradient or activation element
    trainable = model.lora_parameters(lora_rank) if lora_rank else psi
    parameters = _weight_bytes(model, lora_rank, quantization, b) / (gpus if zero_stage == 3 else 1)
    gradients = b * trainable / (gpus if zero_stage >= 2 else 1)
    optimizer = (12 if b == 2 else 8) * trainable / (gpus if zero_stage >= 1 else 1)
    host_optimizer = optimizer if offload_optimizer else 0.0
    optimizer = 0.0 if offload_optimizer else optimizer
    layer_working_set = t * (10 * h + 4 * i + len(LORA_PROJECTIONS) * lora_rank) * b
    host_activations = layers * t * h * b if offload_activations else 0.0
    if gradient_checkpointing:
        activations = (2 if offload_activations else layers) * t * h * b + layer_working_set
    else:
        activations = layers * layer_working_set
    logits_naive = t * v * (2 + 4 + 4)
    logits_fused = t * 4 * 4 + min(workspace_mb * 2**20, t * v * b)
    kv_tokens = tokens_per_gpu if kv_tokens_per_gpu is None else kv_tokens_per_gpu
    kv_per_token = 2 * layers * model.num_kv_heads * model.head_dim * 2
    return MemoryPlan(
        model=model.name, num_parameters=psi, gpus=gpus, zero_stage=zero_stage, tokens_per_gpu=t,
        parameters=parameters, gradients=gradients, optimizer_states=optimizer, activations=activations,
        logits_naive=logits_naive, logits_fused=logits_fused,
        rollout_weights=2 * psi / rollout_tp, rollout_kv_cache=kv_tokens * kv_per_token,
        gpu_memory=gpu_memory_gib * GIB, zero3_gathered=2 * v * h * 2 if zero_stage == 3 else 0.0,
        host_optimizer_states=host_optimizer, trainable_parameters=trainable, host_activations=host_activations,
    )


def _check_lora(rank: int, quantization: str, zero_stage: int, offload_activations: bool, checkpointing: bool) -> None:
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0, got {rank!r}")
    if quantization not in ("none", "4bit"):
        raise ValueError(f"quantization must be 'none' or '4bit', got {quantization!r}")
    if quantization == "4bit" and (rank == 0 or zero_stage == 3):
        raise ValueError("quantization 4bit needs lora_rank > 0 (QLoRA) and zero_stage <= 2")
    if offload_activations and not checkpointing:
        raise ValueError("offload_activations moves gradient checkpointing's layer inputs: needs checkpointing")


def _weight_bytes(model: ModelShape, lora_rank: int, quantization: str, b: int = 2) -> float:
    """The policy's weights on the GPU: ``b`` bytes each (bf16: 2), or the decoder's Linears in NF4; plus
    the adapters."""
    psi = model.num_parameters()
    if quantization != "4bit":
        return b * psi + b * model.lora_parameters(lora_rank) * (lora_rank > 0)
    linear = model.linear_parameters()
    return NF4_BYTES * linear + b * (psi - linear) + b * model.lora_parameters(lora_rank)


# `fastcov plan --model` without --tokens-per-gpu: the trainer's trainer.micro_token_budget default
DEFAULT_TOKENS_PER_GPU = 8192


def default_zero_stage(gpus: int, quantization: str = "none") -> int:
    """--zero's default: nothing to shard on one GPU; ZeRO-3 on several, ZeRO-2 for a 4-bit base (ZeRO-3 cannot
    partition 4-bit weights)."""
    if gpus == 1:
        return 0
    return 2 if quantization == "4bit" else 3


# vLLM after a level-2 sleep keeps neither weights nor KV cache; its CUDA graphs and allocator pool stay.
# An assumption until a GPU run measures it (docs/trainer.md).
VLLM_SLEEP_RESIDUE_GIB = 2.0


def model_shape_of(mcfg) -> ModelShape:
    """The shape of a trainer ``model`` section: ``model.path`` as ``load_model_shape`` reads it (a local
    directory's config.json, a Qwen2.5 preset by its Hub name, a cached Hub config), or the inline ``model.arch``."""
    if mcfg.path is not None:
        return load_model_shape(str(mcfg.path), flag="model.path")
    arch = dict(mcfg.arch or {})
    arch.setdefault("vocab_size", 32000)
    return ModelShape.from_hf_config(arch, name="arch")


def plan_recipe(cfg, gpus: int = 8, gpu_memory_gib: float = 80.0, workspace_mb: float = 256.0) -> MemoryPlan:
    """The per-GPU plan of a trainer config as it would run on ``gpus`` GPUs: its model, ZeRO stage,
    optimizer offload, gradient checkpointing, micro-batch token budget and rollout engine.

    Rollout engines: vLLM colocated takes ``vllm_gpu_memory_utilization`` of each GPU while it generates
    (weights over its tensor-parallel group and KV cache inside that share) and keeps
    ``VLLM_SLEEP_RESIDUE_GIB`` while the policy trains; the HF engine shares the policy's weights under
    ZeRO 0-2 and keeps its own bf16 copy under ZeRO-3, with a KV cache of ``rollout.token_budget``
    tokens, or, when that is 0 (no limit), of every sequence it samples at once: the rank's prompts × n ×
    (max_prompt_len + max_new_tokens), times the ranks of a node (at most 8) when one copy samples for
    the node. With ``rollout.hf_copies: node`` only the first GPU of each node holds the copy, and the
    plan is that GPU's (the busiest). The policy's resident state (parameters, gradients, optimizer
    states) stays on the GPU during rollouts.
    """
    t, r = cfg.trainer, cfg.rollout
    kv_tokens = r.token_budget or t.micro_token_budget
    if r.engine == "hf" and not r.token_budget:
        rows = -(-t.prompts_per_step // gpus) * r.n
        if t.zero_stage == 3 and r.hf_copies == "node":
            rows *= min(gpus, 8)
        kv_tokens = rows * (cfg.data.max_prompt_len + r.max_new_tokens)
    plan = plan_memory(model_shape_of(cfg.model), gpus=gpus, tokens_per_gpu=t.micro_token_budget,
                       zero_stage=t.zero_stage, gpu_memory_gib=gpu_memory_gib,
                       rollout_tp=r.vllm_tensor_parallel_size if r.engine == "vllm" else 1,
                       kv_tokens_per_gpu=kv_tokens,
                       gradient_checkpointing=cfg.model.gradient_checkpointing,
                       offload_optimizer=t.offload_optimizer, workspace_mb=workspace_mb,
                       lora_rank=getattr(cfg.model, "lora_rank", 0),
                       quantization=getattr(cfg.model, "quantization", "none"),
                       offload_activations=getattr(t, "offload_activations", False))
    if r.engine == "vllm" and r.vllm_mode == "colocated":
        plan.rollout_engine = "vllm"
        share = r.vllm_gpu_memory_utilization * gpu_memory_gib * GIB
        plan.rollout_kv_cache = max(0.0, share - plan.rollout_weights)  # vLLM fills its share with KV cache
        plan.rollout_during_training = VLLM_SLEEP_RESIDUE_GIB * GIB
    elif r.engine == "vllm":  # vLLM servers on other GPUs
        plan.rollout_engine = "separate"
        plan.rollout_weights = plan.rollout_kv_cache = 0.0
    elif t.zero_stage == 3:
        plan.rollout_engine = "hf-copy"
        plan.rollout_weights = 2 * plan.num_parameters
        plan.rollout_during_training = plan.rollout_weights
    else:
        plan.rollout_engine = "hf-shared"
        plan.rollout_weights = 0.0
    return plan


def format_plan(plan: MemoryPlan) -> str:
    gib = lambda x: f"{x / GIB:9.2f} GiB"  # noqa: E731
    rows = [
        ("parameters (bf16; NF4 base with 4bit)", plan.parameters),
        ("gradients (bf16)", plan.gradients),
        ("optimizer states (fp32 master + Adam)", plan.optimizer_states),
        ("activations (checkpointed)", plan.activations),
        ("logits, fused (fastcov)", plan.logits_fused),
        ("logits, naive (materialized)", plan.logits_naive),
        ("ZeRO-3 gathered LM head + gradient", plan.zero3_gathered),
        ("rollout engine while training", plan.rollout_during_training),
        ("training total, fused", plan.training_total),
        ("training total, naive", plan.training_total_naive),
        (f"rollout weights ({plan.rollout_engine})", plan.rollout_weights),
        ("rollout KV cache (bf16)", plan.rollout_kv_cache),
        ("rollout total" + (" (+ policy state)" if plan.rollout_engine != "separate" else ""), plan.rollout_total),
    ]
    if plan.host_optimizer_states:
        rows.append(("host memory: optimizer states (offloaded)", plan.host_optimizer_states))
    if plan.host_activations:
        rows.append(("host memory: checkpointed activations", plan.host_activations))
    trains = ""
    if plan.trainable_parameters and plan.trainable_parameters != plan.num_parameters:
        trains = f" ({plan.trainable_parameters / 1e6:.1f}M trainable: LoRA)"
    lines = [
        f"{plan.model}: {plan.num_parameters / 1e9:.2f}B parameters{trains}, {plan.gpus} GPUs, ZeRO-{plan.zero_stage}, "
        f"{plan.tokens_per_gpu} tokens per GPU",
        "per GPU:",
    ]
    lines += [f"  {name:<40s}{gib(value)}" for name, value in rows]
    verdict = lambda ok: "fits" if ok else "does NOT fit"  # noqa: E731
    peak = max(plan.training_total, plan.rollout_total)
    lines.append(f"GPU memory {plan.gpu_memory / GIB:.0f} GiB: peak {peak / GIB:.1f} GiB; "
                 f"fused {verdict(plan.fits())}, "
                 f"naive {verdict(plan.fits(naive=True))}")
    return "\n".join(lines)


def preset_of(spec: str) -> ModelShape | None:
    """The Qwen2.5 preset a name or Hub id names (``qwen2.5-7b``, ``Qwen/Qwen2.5-7B``, ``Qwen/Qwen2.5-7B-Instruct``:
    an instruct model has its base's shape), or None."""
    name = spec.rstrip("/").rsplit("/", 1)[-1].lower()
    return QWEN25.get(name.removesuffix("-instruct"))


def _read_config(path: Path, flag: str, name: str) -> ModelShape:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {str(path)!r} ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag}: {str(path)!r} is not valid JSON ({getattr(exc, 'msg', exc)})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{flag}: {str(path)!r} must hold a JSON object (a Hugging Face config.json)")
    try:
        return ModelShape.from_hf_config(config, name=name)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{flag}: {str(path)!r}: {exc}") from None


def _cached_hub_config(repo_id: str) -> str | None:
    """The config.json of Hub model ``repo_id`` in the local Hugging Face cache, never downloaded; None if absent."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return found if isinstance(found, str) else None


def load_model_shape(spec: str, flag: str = "--model") -> ModelShape:
    """The shape ``spec`` names, read offline: a preset (``qwen2.5-7b``), a local model directory or config.json,
    a Hub id of a preset (``Qwen/Qwen2.5-7B``), or any other Hub id whose config.json is in the local Hugging Face
    cache. Nothing is downloaded. ``flag``: how errors name the setting."""
    if spec.lower() in QWEN25:
        return QWEN25[spec.lower()]
    if (gguf := _gguf_in(spec)) is not None:
        return gguf_model_shape(gguf, name=spec)
    local = Path(spec).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(f"{flag}: {spec!r} is a directory without config.json; give a Hugging Face model "
                             "directory")
        return _read_config(local / "config.json", flag, spec)
    if local.is_file():
        return _read_config(local, flag, spec)
    preset = preset_of(spec)
    if preset is not None:
        return preset
    if spec.endswith(".json") or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ValueError(f"{flag}: no such config file or directory {spec!r}")
    if spec.count("/") == 1:  # a Hub id
        cached = _cached_hub_config(spec)
        if cached is not None:
            return _read_config(Path(cached), flag, spec)
        raise ValueError(f"{flag}: the Hub model {spec!r} is not a preset and its config.json is not in the Hugging "
                         f"Face cache (plan never downloads): fetch it (hf download {spec} config.json) or give a "
                         f"local directory; presets: {', '.join(QWEN25)}")
    raise ValueError(f"{flag}: unknown preset {spec!r}; presets are {', '.join(QWEN25)}, a Hub id (Qwen/Qwen2.5-7B), "
                     "or a model directory or config.json path")


def _gguf_in(spec: str) -> str | None:
    """The GGUF file ``spec`` names: itself (``*.gguf``), or the one in a directory without config.json."""
    import os

    if spec.lower().endswith(".gguf"):
        return spec
    if os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, "config.json")):
        found = sorted(f for f in os.listdir(spec) if f.lower().endswith(".gguf"))
        if len(found) == 1:
            return os.path.join(spec, found[0])
    return None


def gguf_model_shape(path: str, name: str = "gguf") -> ModelShape:
    """The shape of the model in a GGUF file, from its header (llama.cpp's ``<arch>.embedding_length``, ...;
    the tensors are not read). Needs the ``gguf`` package (``fastcov[gguf]``)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(f"--model: {path!r} is a GGUF file, and reading one needs the gguf package: "
                         "pip install 'fastcov[gguf]'") from None
    try:
        reader = GGUFReader(path)
    except FileNotFoundError:
        raise ValueError(f"--model: no such GGUF file {path!r}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model: {path!r} is not a readable GGUF file ({exc})") from None

    def value(key: str):
        field = reader.fields.get(key)
        if field is None:
            raise ValueError(f"--model: {path!r} has no {key!r} in its header")
        part = field.parts[field.data[0]]
        return bytes(part).decode("utf-8") if key == "general.architecture" else part.tolist()[0]

    arch = value("general.architecture")
    heads = int(value(f"{arch}.attention.head_count"))
    try:
        kv_heads = int(value(f"{arch}.attention.head_count_kv"))
    except ValueError:
        kv_heads = heads
    tensors = {t.name for t in reader.tensors}
    return ModelShape(name=name, hidden_size=int(value(f"{arch}.embedding_length")),
                      intermediate_size=int(value(f"{arch}.feed_forward_length")),
                      num_layers=int(value(f"{arch}.block_count")), num_heads=heads, num_kv_heads=kv_heads,
                      vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
                      tie_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors)


def plan_response(model: ModelShape, response: int, *, prompt_len: int = 512, rollouts: int = 8,
                  gpu_memory_gib: float = 80.0, **kw) -> MemoryPlan:
    """One GPU, ZeRO-0, the HF engine sampling from the policy's own module: the training pass holds one
    sequence of ``prompt_len + response`` tokens, the KV cache ``rollouts`` of them."""
    seq = prompt_len + response
    plan = plan_memory(model, gpus=1, tokens_per_gpu=seq, zero_stage=0, gpu_memory_gib=gpu_memory_gib,
                       kv_tokens_per_gpu=rollouts * seq, **kw)
    plan.rollout_engine, plan.rollout_weights = "hf-shared", 0.0
    return plan


def max_response(model: ModelShape, *, prompt_len: int = 512, rollouts: int = 8, gpu_memory_gib: float = 80.0,
                 **kw) -> tuple[int, MemoryPlan | None]:
    """The longest response (tokens) whose ``plan_response`` fits, by bisection; (0, None) if none does."""
    def fits(r: int) -> bool:
        return plan_response(model, r, prompt_len=prompt_len, rollouts=rollouts, gpu_memory_gib=gpu_memory_gib,
                             **kw).fits()

    if not fits(1):
        return 0, None
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 30:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, plan_response(model, lo, prompt_len=prompt_len, rollouts=rollouts, gpu_memory_gib=gpu_memory_gib, **kw)
