"""Hugging Face transformers: per-token log-prob and entropy from the fused kernel, no full logits.

    pip install 'fastcov[hf]'
    from fastcov.integrations.transformers import apply_fastcov
    model = apply_fastcov(AutoModelForCausalLM.from_pretrained(path))
    out = model(input_ids, attention_mask=mask, labels=labels)   # labels aligned with input_ids, -100 = ignore
    out.logprob, out.entropy   # [B, T] fp32: position t holds log π(labels[t] | tokens < t); position 0 is 0
    out.loss                   # mean negative log-likelihood over the labelled positions (SFT-compatible)

Without labels the model runs unchanged (logits, generation).

What is fused. The kernel computes log_softmax((W·h + b) / T) from the decoder's last hidden state h, the
output embedding W (tied to the input embedding or not), its optional bias b and ``temperature`` T. That is the
model's own log_softmax(logits / T) only when the model's logits are exactly ``lm_head(last_hidden_state)``.
``apply_fastcov`` checks this when it is called, not at the first forward, and raises ``UnsupportedModelError``
(a ValueError) naming the model class and the attribute otherwise:

* the class must be on ``EXACT_ARCHITECTURES``: the causal-LM classes of transformers whose forward is
  ``lm_head(decoder(...).last_hidden_state)`` with nothing in between or after, each checked against the model's
  own logits in fp32 by fastcov's tests (transformers 5.23); any other class (ModernBertDecoder, multimodal
  wrappers, models with extra heads, remote code) is refused unless ``allow_unlisted=True``, which keeps
  every other check;
* no config attribute that transforms the logits (``LOGIT_TRANSFORMS``: soft-capping, logit scales,
  multipliers such as FalconH1's ``lm_head_multiplier``, Granite's ``logits_scaling``, vocabulary slicing), but
  Gemma 2's soft cap: on the classes of ``SOFTCAP_ARCHITECTURES`` (Gemma 2/3/4, VaultGemma, NanoChat, Beam), whose
  forward is cap·tanh(lm_head(h)/cap) with ``final_logit_softcapping`` = cap, the kernel applies the same cap
  (``softcap=``, before the temperature, as their sampling does);
* the output embedding is a plain ``torch.nn.Linear`` held directly by the model, and the model has no other
  child with parameters than the decoder and the head (RobertaForCausalLM's head has dense + layer norm);
* the head's weight is float32, float16 or bfloat16 (the kernel's dtypes; float64 is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from fastcov.integrations._require import require
from fastcov.ops import FLOAT_DTYPES, LogprobEntropy, linear_logprob_entropy

transformers = require("transformers", "transformers", "'fastcov[hf]'")
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.utils import ModelOutput  # noqa: E402

# The KV cache's field in a model output: ``cache`` in recent transformers (5.24), which renames a
# ``past_key_values`` keyword to it; ``past_key_values`` before.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class UnsupportedModelError(ValueError):
    """The model's logits are not lm_head(last hidden state), so the fused kernel would not equal them."""


# Causal-LM classes of transformers whose logits are exactly lm_head(decoder(...).last_hidden_state), as far as
# fastcov's architecture sweep (tests/integrations/test_integration_hf_architectures.py) has verified, transformers
# 5.23.
EXACT_ARCHITECTURES = frozenset({
    "AXK1ForCausalLM", "AXK2ForCausalLM", "AfmoeForCausalLM", "ApertusForCausalLM", "ArceeForCausalLM",
    "AriaTextForCausalLM", "BailingHybridForCausalLM", "BambaForCausalLM", "BartForCausalLM",
    "BigBirdPegasusForCausalLM", "BioGptForCausalLM", "BitNetForCausalLM", "BlenderbotForCausalLM",
    "BlenderbotSmallForCausalLM", "BloomForCausalLM", "CTRLLMHeadModel", "CodeGenForCausalLM", "CpmAntForCausalLM",
    "CwmForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM",
    "DiffLlamaForCausalLM", "DogeForCausalLM", "Dots3NoteForCausalLM", "Emu3ForCausalLM", "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM", "Exaone4ForCausalLM", "ExaoneMoeForCausalLM", "FalconForCausalLM",
    "FalconH1ForCausalLM", "FalconMambaForCausalLM", "FlexOlmoForCausalLM", "FlintForCausalLM", "GPT2LMHeadModel",
    "GPTBigCodeForCausalLM", "GPTJForCausalLM", "GPTNeoForCausalLM", "GPTNeoXForCausalLM",
    "GPTNeoXJapaneseForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM", "Gemma4UnifiedForCausalLM",
    "GemmaForCausalLM", "GitForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
    "GlmForCausalLM", "GlmMoeDsaForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
    "GraniteMoeHybridForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM",
    "GraniteSWAForCausalLM", "HYV3ForCausalLM", "HYV4ForCausalLM", "HeliumForCausalLM", "HrmTextForCausalLM",
    "HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM", "HyperCLOVAXForCausalLM", "Jais2ForCausalLM",
    "JambaForCausalLM", "JetMoeForCausalLM", "Kolibri1ForCausalLM", "LagunaForCausalLM", "Lfm2ForCausalLM",
    "Lfm3ForCausalLM", "LlamaForCausalLM", "LongcatFlashForCausalLM", "MBartForCausalLM", "Mamba2ForCausalLM",
    "MambaForCausalLM", "MarianForCausalLM", "MellumForCausalLM", "MiMoV2FlashForCausalLM", "MiniMaxForCausalLM",
    "MiniMaxM2ForCausalLM", "MiniMaxM3VLForCausalLM", "Ministral3ForCausalLM", "MinistralForCausalLM",
    "MistralForCausalLM", "MixtralForCausalLM", "MoshiForCausalLM", "MptForCausalLM", "MvpForCausalLM",
    "NemotronForCausalLM", "NemotronHForCausalLM", "OPTForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
    "OlmoForCausalLM", "OlmoeForCausalLM", "OpenAIGPTLMHeadModel", "PLBartForCausalLM", "PegasusForCausalLM",
    "PersimmonForCausalLM", "Phi3ForCausalLM", "Phi4MultimodalForCausalLM", "PhiForCausalLM", "PhimoeForCausalLM",
    "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen4ExpForCausalLM", "RwkvForCausalLM", "SeedOssForCausalLM",
    "SmolLM3ForCausalLM", "SolarOpenForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM",
    "TrOCRForCausalLM", "WhisperForCausalLM", "XGLMForCausalLM", "XLNetLMHeadModel", "YoutuForCausalLM",
    "ZambaForCausalLM", "ZayaForCausalLM",
    # exact with their logit transform at its neutral value (checked through LOGIT_TRANSFORMS)
    "BeamForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "CohereForCausalLM", "Gemma2ForCausalLM",
    "InklingForCausalLM", "NanoChatForCausalLM", "VaultGemmaForCausalLM",
})

# Classes whose forward caps the head's logits as cap·tanh(lm_head(h)/cap), cap = config.final_logit_softcapping (of
# the model's config or its text config), with nothing else between the head and the logits: the fused kernel's
# softcap= computes the same (checked against the model's own logits at the default cap by the architecture sweep).
SOFTCAP_ARCHITECTURES = frozenset({
    "BeamForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM", "Gemma4UnifiedForCausalLM",
    "NanoChatForCausalLM", "VaultGemmaForCausalLM",
})
SOFTCAP_ATTRIBUTE = "final_logit_softcapping"

# config attributes (of the model's config or its text config) that change the logits after the LM head,
# with the values that leave them unchanged
_NEUTRAL_SOFTCAP = (None, 0, 0.0)
_NEUTRAL_SCALE = (None, 1, 1.0)
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": _NEUTRAL_SOFTCAP,
    "logit_softcapping": _NEUTRAL_SOFTCAP,
    "softcap": _NEUTRAL_SOFTCAP,
    "logits_soft_cap": _NEUTRAL_SOFTCAP,
    "output_logit_soft_cap": _NEUTRAL_SOFTCAP,
    "logit_scale": _NEUTRAL_SCALE,
    "logits_scaling": _NEUTRAL_SCALE,
    "lm_head_multiplier": _NEUTRAL_SCALE,
    "output_multiplier": _NEUTRAL_SCALE,
    "output_multiplier_scale": _NEUTRAL_SCALE,
    "logit_multiplier": _NEUTRAL_SCALE,
    "logits_mup_width_multiplier": _NEUTRAL_SCALE,
    "unpadded_vocab_size": (None,),
}


@dataclass
class FastcovCausalLMOutput(ModelOutput):
    """Output of a patched model called with labels. logprob/entropy/vocab_cov: [B, T] fp32. The KV
    cache, if any, is in ``cache`` or ``past_key_values``, the field the installed transformers uses."""

    loss: torch.Tensor | None = None
    logprob: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    vocab_cov: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: object | None = None
    cache: object | None = None
    hidden_states: tuple | None = None
    attentions: tuple | None = None
    aux_loss: torch.Tensor | None = None  # an MoE model's load-balancing loss (fastcov.integrations.trl)


def _refuse(model, what: str) -> NoReturn:
    raise UnsupportedModelError(f"apply_fastcov: {type(model).__name__} {what}; the fused kernel would not give "
                                f"the model's own log-probs, so it is refused")


def _configs(model):
    config = getattr(model, "config", None)
    if config is None:
        return []
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError:  # several text configs (e.g. music models): check the top-level config only
        text = config
    return [("config", config)] + ([("config.text_config", text)] if text is not config else [])


def _child_name(model, module) -> str | None:
    for name, child in model.named_children():
        if child is module:
            return name
    return None


def _is_neutral(value, neutral) -> bool:
    return any(value is n or (type(value) in (int, float) and value == n) for n in neutral)


def logit_softcap(model) -> float | None:
    """The cap the model applies to its logits as cap·tanh(logits/cap) (``final_logit_softcapping`` of a class on
    ``SOFTCAP_ARCHITECTURES``), or None."""
    if type(model).__name__ not in SOFTCAP_ARCHITECTURES:
        return None
    for _, config in reversed(_configs(model)):  # the text config's, where the model has one
        value = getattr(config, SOFTCAP_ATTRIBUTE, None)
        if value is not None and not _is_neutral(value, LOGIT_TRANSFORMS[SOFTCAP_ATTRIBUTE]):
            return float(value)
    return None


def decoder_and_head(model, *, allow_unlisted: bool = False):
    """(decoder, head) of a model the fused path is exact for; ``UnsupportedModelError`` otherwise."""
    capped = type(model).__name__ in SOFTCAP_ARCHITECTURES
    for where, config in _configs(model):
        for attr, neutral in LOGIT_TRANSFORMS.items():
            value = getattr(config, attr, None)
            if capped and attr == SOFTCAP_ATTRIBUTE and value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    _refuse(model, f"has a soft cap the kernel cannot apply ({where}.{attr}={value!r})")
                continue
            if not _is_neutral(value, neutral):
                _refuse(model, f"transforms its logits ({where}.{attr}={value!r})")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        _refuse(model, "has no output embedding (get_output_embeddings() is None)")
    head_name = _child_name(model, head)
    if head_name is None:
        owner, parent = next(((name, module) for name, module in model.named_modules()
                              if any(child is head for child in module.children())), ("?", None))
        others = [f"{owner}.{name}" for name, child in getattr(parent, "named_children", lambda: [])()
                  if child is not head]
        where = f"head module {owner!r} ({type(parent).__name__})"
        _refuse(model, f"computes its logits in the {where} with other layers: {', '.join(others)}" if others
                else f"computes its logits in the forward of its {where}, not with the output embedding alone")
    if type(head) is not torch.nn.Linear:
        _refuse(model, f"has an output embedding {head_name!r} of type {type(head).__name__}, not a plain "
                       f"torch.nn.Linear")
    if head.weight.dtype not in FLOAT_DTYPES:
        _refuse(model, f"has {head_name}.weight in {head.weight.dtype}; the fused kernel takes float32, float16 "
                       f"or bfloat16 (cast the model, e.g. model.float())")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model or decoder is head:
        _refuse(model, "has no separate decoder module (get_decoder())")
    decoder_params = {id(p) for p in decoder.parameters()} | {id(p) for p in head.parameters()}
    for name, child in model.named_children():
        if child is head or child is decoder:
            continue
        extra = [n for n, p in child.named_parameters() if id(p) not in decoder_params]
        if extra:
            _refuse(model, f"has parameters outside its decoder ({type(decoder).__name__}) and head {head_name!r}: "
                           f"{name}.{extra[0]}" + (f" and {len(extra) - 1} more" if len(extra) > 1 else ""))
    if type(model).__name__ not in EXACT_ARCHITECTURES and not allow_unlisted:
        _refuse(model, "is not on fastcov's list of architectures whose logits are lm_head(last hidden state) "
                       "(fastcov.integrations.transformers.EXACT_ARCHITECTURES; pass allow_unlisted=True if you "
                       "have checked it)")
    return decoder, head


def fused_logprob_entropy(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *,
                          temperature: float = 1.0, vocab_cov: bool = False, impl: str = "auto",
                          ignore_index: int = -100) -> LogprobEntropy:
    """Per-token stats of labels [B, T] from the decoder's hidden [B, T, D], shifted so that position
    t scores labels[:, t] from hidden[:, t-1], with the model's soft cap (``logit_softcap``) where it has one.
    Returns a ``LogprobEntropy`` of [B, T] tensors."""
    _, head = decoder_and_head(model, allow_unlisted=bool(getattr(model, "_fastcov_allow_unlisted", False)))
    targets = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)), dim=1)
    stats = linear_logprob_entropy(hidden, head.weight, targets, bias=head.bias, temperature=temperature,
                                   ignore_index=ignore_index, vocab_cov=vocab_cov, impl=impl,
                                   softcap=logit_softcap(model))

    def shift(t):  # untyped: None stays None, a tensor stays a tensor
        return None if t is None else torch.nn.functional.pad(t[:, :-1], (1, 0))

    return stats._replace(logprob=shift(stats.logprob), entropy=shift(stats.entropy),
                          logsumexp=shift(stats.logsumexp), vocab_cov=shift(stats.vocab_cov))


def apply_fastcov(model, *, temperature: float = 1.0, vocab_cov: bool = False, impl: str = "auto",
                  ignore_index: int = -100, allow_unlisted: bool = False):
    """Patch ``model`` (in place, returned) so that a forward with ``labels`` returns per-token
    logprob and entropy from the fused kernel and never computes the logits.

    Raises ``UnsupportedModelError`` (a ValueError naming the class and attribute) now, before any forward,
    when the fused path would not equal the model's own log_softmax(logits / temperature); see the module
    docstring. ``allow_unlisted=True`` accepts a class that is not on ``EXACT_ARCHITECTURES`` (all other
    checks still apply): only for a model whose logits you know to be lm_head(last hidden state).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    decoder, _ = decoder_and_head(model, allow_unlisted=allow_unlisted)
    model._fastcov_allow_unlisted = allow_unlisted
    if getattr(model, "_fastcov_original_forward", None) is not None:
        return model
    original_forward = model.forward

    # The KV cache (``past_key_values``, or ``cache`` in recent transformers) travels in kwargs under the
    # caller's name, so neither name is passed to a forward that warns about it or lacks it.
    def forward(input_ids=None, attention_mask=None, position_ids=None,
                inputs_embeds=None, labels=None, use_cache=None, **kwargs):
        if labels is None:
            return original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids,
                                    inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("num_items_in_batch", None)
        given = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     inputs_embeds=inputs_embeds, use_cache=use_cache)
        outputs = decoder(**{k: v for k, v in given.items() if v is not None}, **kwargs)
        stats = fused_logprob_entropy(model, outputs.last_hidden_state, labels, temperature=temperature,
                                      vocab_cov=vocab_cov, impl=impl, ignore_index=ignore_index)
        labelled = torch.cat((torch.zeros_like(labels[:, :1], dtype=torch.bool),
                              labels[:, 1:] != ignore_index), dim=1)
        loss = -stats.logprob.sum() / labelled.sum().clamp(min=1)
        return FastcovCausalLMOutput(loss=loss, logprob=stats.logprob, entropy=stats.entropy,
                                     vocab_cov=stats.vocab_cov,
                                     **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD, None)},
                                     hidden_states=getattr(outputs, "hidden_states", None),
                                     attentions=getattr(outputs, "attentions", None))

    model._fastcov_original_forward = original_forward
    model.forward = forward
    return model


def revert_fastcov(model: Any) -> Any:  # a transformers model (its attributes are set)
    """Undo ``apply_fastcov``."""
    original = getattr(model, "_fastcov_original_forward", None)
    if original is not None:
        model.forward = original
        model._fastcov_original_forward = None
    return model
