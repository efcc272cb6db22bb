"""The ``model`` section: which model, its dtype and attention, LoRA / QLoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from fastcov.trainer.config.base import check as _check

# The attention and MLP projections of Qwen2/Llama-style decoders: model.lora_targets' default.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelConfig:
    # Hugging Face path or directory (from_pretrained); None builds a fresh model from `arch`.
    path: str | None = None
    # Inline architecture for a fresh model: transformers config kwargs plus `model_type` (e.g. qwen2).
    arch: dict[str, Any] | None = None
    # Tokenizer path; "builtin:arith" builds the offline word-level tokenizer of the synthetic task.
    # None means: the tokenizer saved next to `path`.
    tokenizer: str | None = None
    gradient_checkpointing: bool = False
    # auto: flash_attention_2 when flash-attn is installed and a GPU is used, else sdpa.
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    # auto: bf16 on GPU, fp32 on CPU.
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # Liger-Kernel's fused RMSNorm, SwiGLU and RoPE on the policy (the LM head is fastcov's own).
    # auto: on a GPU when liger-kernel is installed (extra `fastcov[liger]`); true: required; false: never.
    liger: bool | Literal["auto"] = "auto"
    # LoRA through peft (docs/trainer.md, "LoRA and QLoRA"): adapters of this rank on the lora_targets
    # modules; only they train, are checkpointed and are synced to the rollout engine, the base stays
    # frozen. 0 = off (every parameter trains).
    lora_rank: int = 0
    lora_alpha: float = 16.0  # adapter scale alpha / rank
    lora_dropout: float = 0.0
    # Linear modules that get adapters; "lm_head" listed: the LM head trains in full (not low-rank),
    # otherwise it stays frozen and the fused kernel skips its dW GEMM.
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # 4bit: QLoRA, the frozen base's Linear layers in NF4 (bitsandbytes, extra `fastcov[lora]`); needs lora_rank > 0.
    quantization: Literal["none", "4bit"] = "none"

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        m = self
        _check((m.path is None) != (m.arch is None), "model.path",
               "set exactly one of model.path (pretrained) and model.arch (fresh model)")
        if m.arch is not None:
            _check("model_type" in m.arch, "model.arch.model_type", "required (e.g. qwen2)")
        _check(m.path is not None or m.tokenizer is not None, "model.tokenizer",
               "required when the model is built from model.arch")
        _check(m.lora_rank >= 0, "model.lora_rank", f"must be >= 0 (0 = off), got {m.lora_rank}")
        _check(m.lora_alpha > 0, "model.lora_alpha", f"must be > 0, got {m.lora_alpha}")
        _check(0 <= m.lora_dropout < 1, "model.lora_dropout", f"must be in [0, 1), got {m.lora_dropout}")
        _check(bool(m.lora_targets) and all(bool(t) for t in m.lora_targets), "model.lora_targets",
               "give at least one module name (e.g. q_proj)")
        _check(m.quantization == "none" or m.lora_rank > 0, "model.quantization",
               "a 4-bit base cannot train: set model.lora_rank > 0 (QLoRA)")

