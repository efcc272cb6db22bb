"""Models and tokenizers: Hugging Face causal LMs by path, or fresh ones from an inline architecture.

The policy never materialises logits: ``PolicyModel.forward`` runs the decoder to its last hidden states
and hands them with the LM head weight to ``fastcov.linear_logprob_entropy``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastcov.errors import ConfigError
from fastcov.trainer.runtime.lora import has_adapters, is_adapter_dir, lora_enabled
from fastcov.trainer.runtime.precision import param_dtype  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _tokenizer_class(name: str) -> str | None:
    import json
    from pathlib import Path

    cfg = Path(name) / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_tokenizer(mcfg) -> PreTrainedTokenizerBase:
    """The tokenizer for a ModelConfig; pad token set (falls back to eos)."""
    from fastcov.trainer.runtime.gguf import gguf_file, load_gguf_tokenizer

    name = mcfg.tokenizer or mcfg.path
    tok: PreTrainedTokenizerBase
    if name == "builtin:arith":
        from fastcov.trainer.data.synthetic import build_tokenizer

        tok = build_tokenizer()
    elif (gguf := gguf_file(name)) is not None:  # the tokenizer and chat template stored in the GGUF file
        tok = load_gguf_tokenizer(gguf)
    else:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            # A plain tokenizers-backed tokenizer (like the builtin one) loads as itself: AutoTokenizer
            # would substitute the model type's own class (Qwen2Tokenizer) and re-tokenize differently.
            if _tokenizer_class(name) in ("TokenizersBackend", "PreTrainedTokenizerFast"):
                tok = PreTrainedTokenizerFast.from_pretrained(name)
            else:
                tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model.tokenizer: cannot load a tokenizer from {name!r}: {exc}") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ValueError(f"model.tokenizer: {name!r} has no eos token")
    return tok


def resolve_attn(choice: str, device: torch.device) -> str:
    if choice != "auto":
        return choice
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def use_liger(choice: bool | str, device: torch.device, installed: bool | None = None) -> bool:
    """Whether to patch the policy with Liger-Kernel (``model.liger``: "auto", True/"on", False/"off"),
    or a ValueError saying why it can't be."""
    choice = {True: "on", False: "off"}.get(choice, choice) if isinstance(choice, bool) else choice
    if installed is None:
        installed = importlib.util.find_spec("liger_kernel") is not None
    if choice == "off" or (choice == "auto" and (device.type != "cuda" or not installed)):
        return False
    if device.type != "cuda":
        raise ValueError("model.liger: Liger-Kernel's Triton kernels need a CUDA GPU; this run is on "
                         f"{device.type} (use model.liger=auto or false)")
    if not installed:
        raise ValueError("model.liger: liger-kernel is not installed: pip install 'fastcov[liger]' "
                         "(or model.liger=false)")
    return True


def apply_liger(model: nn.Module, required: bool = False) -> bool:
    """Liger-Kernel's RMSNorm, SwiGLU and RoPE in place of the model's own; its cross-entropy paths stay off
    (the policy's head is fastcov's fused kernel). A model type Liger has no patch for is left as it is,
    or refused when ``required``. Returns whether it patched."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        if required:
            raise ValueError(f"model.liger: Liger-Kernel has no patch for model type {model_type!r}; "
                             "set model.liger=auto or false")
        return False
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True,
                                    cross_entropy=False, fused_linear_cross_entropy=False)
    return True


def build_model(mcfg, device: torch.device, dtype: torch.dtype, tokenizer=None,
                ds_config: dict | None = None) -> nn.Module:
    """A causal LM (``dtype`` parameters on ``device``): ``from_pretrained(path)`` or fresh from ``arch``.

    ``ds_config``: the DeepSpeed config the policy will be trained with. With ZeRO stage 3 the model is
    created partitioned (transformers' DeepSpeed integration: ``HfDeepSpeedConfig`` before loading, so
    construction runs inside ``deepspeed.zero.Init`` and a checkpoint's tensors go straight into each
    rank's partition): no rank ever holds more than its 1/world share plus the layer being built.
    """

    attn = resolve_attn(mcfg.attn_implementation, device)
    zero3 = bool(ds_config) and ds_config.get("zero_optimization", {}).get("stage") == 3
    if zero3:
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        # transformers reads ZeRO-3 from this live object (a weak reference): it lives while the model
        # is built, and is unset after, so that no later model of the process is built partitioned.
        hf_ds_config = HfDeepSpeedConfig(ds_config)
        try:
            model = _construct(mcfg, dtype, attn, tokenizer)
        finally:
            unset_hf_deepspeed_config()
            del hf_ds_config
    else:
        model = _construct(mcfg, dtype, attn, tokenizer)
    if lora_enabled(mcfg):  # adapters in, base frozen (4-bit: quantized by the move to the device below)
        from fastcov.trainer.runtime.lora import add_adapters

        model = add_adapters(model, mcfg, dtype)
    liger = getattr(mcfg, "liger", False)
    if use_liger(liger, device):
        apply_liger(model, required=liger is True or liger == "on")
    if mcfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24's name; the old one warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model if zero3 else model.to(device)  # ZeRO-3 partitions already sit on the device


def _construct(mcfg, dtype: torch.dtype, attn: str, tokenizer) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastcov.trainer.runtime.gguf import gguf_file, load_gguf_model

    if (gguf := gguf_file(mcfg.path)) is not None:  # read in place (a run trains on its converted copy)
        model = load_gguf_model(gguf, dtype, attn)
    elif mcfg.path is not None:
        try:
            model = AutoModelForCausalLM.from_pretrained(mcfg.path, dtype=dtype, attn_implementation=attn)
        except Exception as exc:
            from fastcov.trainer.runtime.errors import unreadable_model

            bad = unreadable_model(mcfg.path, exc)
            if bad is None:
                raise
            raise bad from exc
    else:
        arch: dict[str, Any] = dict(mcfg.arch)
        model_type = arch.pop("model_type")
        if tokenizer is not None:
            arch.setdefault("vocab_size", len(tokenizer))
            arch.setdefault("eos_token_id", tokenizer.eos_token_id)
            arch.setdefault("pad_token_id", tokenizer.pad_token_id)
            arch.setdefault("bos_token_id", None)
        try:
            config = AutoConfig.for_model(model_type, **arch)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"model.arch: {exc}") from exc
        config._attn_implementation = attn
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model


def decoder_of(model: nn.Module) -> nn.Module:
    """The module that maps input ids to last hidden states (``model.model`` for Qwen2/Llama), found by
    the one helper every integration uses (``fastcov.integrations.transformers.decoder_and_head``),
    which also refuses heads the fused kernel is not exact for."""
    from fastcov.integrations.transformers import decoder_and_head

    return decoder_and_head(model)[0]


class PolicyModel(nn.Module):
    """Wraps a causal LM so that its forward returns per-token log-probs and entropies, never logits.

    Under ZeRO-3 the LM head weight is used outside its own module's forward, so the caller registers
    it as an external parameter of this wrapper (``register_external_head``).
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        decoder_of(lm)  # refuse, at build time, a model whose logits are not lm_head(last hidden state)
        self.lm = lm
        from fastcov.integrations.transformers import logit_softcap

        self.softcap = logit_softcap(lm)

    def register_external_head(self) -> None:
        from deepspeed.runtime.zero import register_external_parameter

        head = self.lm.get_output_embeddings()
        register_external_parameter(self, head.weight)
        if getattr(head, "bias", None) is not None:
            register_external_parameter(self, head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                temperature: float | torch.Tensor = 1.0, entropy: bool = True, vocab_cov: bool = False,
                position_ids: torch.Tensor | None = None, sum_p2: bool = False):
        """input_ids, attention_mask, labels: int64 [B, T] (labels[t] is the token that follows position t,
        ``-100`` where no loss is taken). Without ``position_ids``: one right-padded sequence per row.
        With ``position_ids`` (int64 [B, T]): packed rows, several sequences per row whose positions
        restart at 0 at each sequence start (and at the trailing padding); attention stays inside each
        sequence (``packed_attention``). ``temperature``: a float, or fp32 [B, T] (one per position: the
        sequences' own sampling temperatures). ``sum_p2``: also Σπ² per position. A soft-capped head (Gemma 2's
        ``final_logit_softcapping``) is capped as the model caps it. Returns fastcov's LogprobEntropy with fp32
        ``logprob``/``entropy`` of shape [B, T] (0 at ignored positions); only the labelled positions reach the
        LM head (``labelled_positions_stats``)."""
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        else:
            attention_mask = packed_attention(position_ids, self.lm.config._attn_implementation, self.lm.dtype)
        hidden = self.lm.get_decoder()(  # checked once in __init__ (decoder_of), not on every forward
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        head = self.lm.get_output_embeddings()
        weight = head.weight
        bias = getattr(head, "bias", None)
        if hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        return labelled_positions_stats(hidden, weight, labels, bias=bias, temperature=temperature,
                                        entropy=entropy, vocab_cov=vocab_cov, sum_p2=sum_p2, softcap=self.softcap)


def labelled_positions_stats(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                             bias: torch.Tensor | None = None, temperature: float | torch.Tensor = 1.0,
                             entropy: bool = True, vocab_cov: bool = False, sum_p2: bool = False,
                             softcap: float | None = None):
    """``fastcov.linear_logprob_entropy`` over the positions whose label is not ``-100`` only.

    hidden [B, T, D], weight [V, D], labels int64 [B, T], temperature a float or fp32 [B, T]. A rollout's
    prompt and padding positions carry no label, and at a real vocabulary the head is most of the model's
    work (Qwen2.5's 151,936 × 896 head costs 272 MFLOP per position forward): the labelled rows are gathered
    into [n, D] before the head, and the results scattered back. Returns a LogprobEntropy of [B, T] fp32
    tensors, 0 at unlabelled positions (``logsumexp`` and ``sum_p2`` too; top-k is not asked for);
    gradients reach ``hidden`` at the labelled positions only, as they do without the gather."""
    from fastcov import linear_logprob_entropy

    valid = labels != -100
    if bool(valid.all()) or not bool(valid.any()):
        return linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=temperature,
                                      entropy=entropy, vocab_cov=vocab_cov, sum_p2=sum_p2, softcap=softcap)
    where = valid.reshape(-1).nonzero()[:, 0]
    if isinstance(temperature, torch.Tensor):  # one per position: the labelled positions' own
        temperature = temperature.reshape(-1).index_select(0, where)
    res = linear_logprob_entropy(hidden.reshape(-1, hidden.shape[-1]).index_select(0, where), weight,
                                 labels.reshape(-1).index_select(0, where), bias=bias, temperature=temperature,
                                 entropy=entropy, vocab_cov=vocab_cov, sum_p2=sum_p2, softcap=softcap)

    def spread(values: torch.Tensor | None) -> torch.Tensor | None:  # [n] -> [B, T], 0 at unlabelled positions
        if values is None:
            return None
        return values.new_zeros(labels.numel()).index_copy(0, where, values).view(labels.shape)

    return res._replace(logprob=spread(res.logprob), entropy=spread(res.entropy), logsumexp=spread(res.logsumexp),
                        vocab_cov=spread(res.vocab_cov), sum_p2=spread(res.sum_p2))


def packed_attention(position_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype):
    """The attention mask of packed rows for the HF decoder, from ``position_ids`` int64 [B, L].

    A segment starts wherever the position is 0. flash_attention_2 takes the packing from the
    position ids themselves (it needs B == 1) and gets None; sdpa gets a block-diagonal causal bool
    mask [B, 1, L, L] (True = may attend); eager the same as an additive mask of ``dtype``
    (0 / dtype's minimum).
    """
    if attn_implementation.startswith("flash_attention"):
        if position_ids.shape[0] != 1:
            raise ValueError(f"packing with {attn_implementation} needs one row per micro-batch, "
                             f"got {position_ids.shape[0]} (micro_batches(..., row_capacity=budget))")
        return None
    segment = (position_ids == 0).long().cumsum(-1)  # [B, L]
    L = position_ids.shape[-1]
    causal = torch.ones((L, L), dtype=torch.bool, device=position_ids.device).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal  # [B, L(query), L(key)]
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        zero = torch.zeros((), dtype=dtype, device=position_ids.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    raise ValueError(f"model.attn_implementation: packing does not support {attn_implementation!r}")


def check_model_source(mcfg, names: tuple[str, str] = ("model.path", "model.tokenizer"),
                       adapters_ok: bool = False) -> None:
    """A local model/tokenizer path that cannot be a Hugging Face directory stops here, before any
    download or write. Hub ids (``org/name`` that is not a local path) are left to transformers.
    ``names``: how the error calls the model and tokenizer settings (config keys, or CLI flags).
    ``adapters_ok``: a saved LoRA adapter (adapter_config.json) is a model too (evaluation)."""
    from fastcov.trainer.runtime.gguf import check_gguf, gguf_file

    for key, value in zip(names, (mcfg.path, mcfg.tokenizer), strict=True):
        if value is None or value.startswith("builtin:"):
            continue
        if (gguf := gguf_file(value)) is not None:  # a .gguf file, or a directory holding one
            check_gguf(gguf, key)
            continue
        p = Path(value).expanduser()
        local = p.exists() or value.startswith((".", "/", "~")) or value.count("/") != 1
        if not local:
            continue
        if not p.exists():
            raise ConfigError(f"{key}: {value!r} does not exist; give a Hugging Face model directory or hub id")
        if not p.is_dir():
            raise ConfigError(f"{key}: {value!r} is a file; give the model's directory (with config.json) "
                              "or a .gguf file")
        if value == mcfg.path and not (p / "config.json").is_file():
            if adapters_ok and is_adapter_dir(p):
                continue
            also = " or adapter_config.json" if adapters_ok else ""
            raise ConfigError(f"{key}: {value!r} is not a Hugging Face model directory (no config.json{also})")


def export_final(model, tokenizer, run_dir: Path) -> Path:
    """``<run_dir>/final`` as a Hugging Face directory, replaced atomically (temp dir, fsync, rename)."""
    import shutil

    from fastcov.trainer.runtime.checkpoint import fsync_path, fsync_tree

    run_dir = Path(run_dir)
    final, tmp, old = run_dir / "final", run_dir / ".final.tmp", run_dir / ".final.old"
    for p in (tmp, old):
        if p.exists():
            shutil.rmtree(p)
    if has_adapters(model):  # LoRA: the adapter alone, in peft's layout (PeftModel.from_pretrained(base, final))
        from fastcov.trainer.runtime.lora import save_adapter

        base = getattr(model.config, "_name_or_path", None) or None
        if base is not None and Path(base).is_dir():  # a local base by its absolute path: the adapter
            base = str(Path(base).resolve())           # loads from any working directory
        save_adapter(model, tmp, base)
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    fsync_tree(tmp)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_path(run_dir)
    if old.exists():
        shutil.rmtree(old)
    return final
