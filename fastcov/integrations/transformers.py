"""Hugging Face transformers: per-token log-prob and entropy from the fused kernel, no full logits.

    from fastcov.integrations.transformers import apply_fastcov
    model = apply_fastcov(AutoModelForCausalLM.from_pretrained(path))
    out = model(input_ids, attention_mask=mask, labels=labels)   # labels aligned with input_ids, -100 = ignore
    out.logprob, out.entropy   # [B, T] fp32: position t holds log π(labels[t] | tokens < t); position 0 is 0
    out.loss                   # mean negative log-likelihood over the labelled positions (SFT-compatible)

Without labels the model runs unchanged (logits, generation). Works for any causal LM whose output
embedding is a plain ``nn.Linear`` applied to the decoder's last hidden state (Qwen2, Llama, Mistral...);
models that transform the logits (soft-capping, logit scaling) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fastcov.integrations._require import require
from fastcov.ops import linear_logprob_entropy

transformers = require("transformers", "transformers", "'fastcov[train]'")
from transformers.utils import ModelOutput  # noqa: E402

# config attributes that change the logits after the LM head; the fused kernel cannot reproduce them
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class FastcovCausalLMOutput(ModelOutput):
    """Output of a patched model called with labels. logprob/entropy/vocab_cov: [B, T] fp32."""

    loss: Optional[torch.Tensor] = None
    logprob: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    vocab_cov: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    past_key_values: Optional[object] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None


def _decoder_and_head(model):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"apply_fastcov needs a causal LM whose output embedding is a plain nn.Linear; "
            f"{type(model).__name__} has {type(head).__name__}"
        )
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(getattr(model, "config", None), attr, None)
        if value not in (None, 0, 1, 1.0, 0.0):
            raise ValueError(
                f"apply_fastcov: {type(model).__name__} transforms its logits ({attr}={value}); "
                f"the fused kernel would give different log-probs, so it is refused"
            )
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if decoder is None or decoder is model:
        raise ValueError(f"apply_fastcov: cannot find the decoder of {type(model).__name__}")
    return decoder, head


def fused_logprob_entropy(model, hidden, labels, *, temperature=1.0, vocab_cov=False, impl="auto",
                          ignore_index=-100):
    """Per-token stats of labels [B, T] from the decoder's hidden [B, T, D], shifted so that position
    t scores labels[:, t] from hidden[:, t-1]. Returns a ``LogprobEntropy`` of [B, T] tensors."""
    _, head = _decoder_and_head(model)
    targets = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)), dim=1)
    stats = linear_logprob_entropy(hidden, head.weight, targets, bias=head.bias, temperature=temperature,
                                   ignore_index=ignore_index, vocab_cov=vocab_cov, impl=impl)
    shift = lambda t: None if t is None else torch.nn.functional.pad(t[:, :-1], (1, 0))  # noqa: E731
    return stats._replace(logprob=shift(stats.logprob), entropy=shift(stats.entropy),
                          logsumexp=shift(stats.logsumexp), vocab_cov=shift(stats.vocab_cov))


def apply_fastcov(model, *, temperature: float = 1.0, vocab_cov: bool = False, impl: str = "auto",
                  ignore_index: int = -100):
    """Patch ``model`` (in place, returned) so that a forward with ``labels`` returns per-token
    logprob and entropy from the fused kernel and never computes the logits."""
    decoder, _ = _decoder_and_head(model)
    if getattr(model, "_fastcov_original_forward", None) is not None:
        return model
    original_forward = model.forward

    def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, **kwargs):
        if labels is None:
            return original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, past_key_values=past_key_values,
                                    inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("num_items_in_batch", None)
        outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                          **kwargs)
        stats = fused_logprob_entropy(model, outputs.last_hidden_state, labels, temperature=temperature,
                                      vocab_cov=vocab_cov, impl=impl, ignore_index=ignore_index)
        labelled = torch.cat((torch.zeros_like(labels[:, :1], dtype=torch.bool),
                              labels[:, 1:] != ignore_index), dim=1)
        loss = -stats.logprob.sum() / labelled.sum().clamp(min=1)
        return FastcovCausalLMOutput(loss=loss, logprob=stats.logprob, entropy=stats.entropy,
                                     vocab_cov=stats.vocab_cov, past_key_values=outputs.past_key_values,
                                     hidden_states=getattr(outputs, "hidden_states", None),
                                     attentions=getattr(outputs, "attentions", None))

    model._fastcov_original_forward = original_forward
    model.forward = forward
    return model


def revert_fastcov(model):
    """Undo ``apply_fastcov``."""
    original = getattr(model, "_fastcov_original_forward", None)
    if original is not None:
        model.forward = original
        model._fastcov_original_forward = None
    return model
