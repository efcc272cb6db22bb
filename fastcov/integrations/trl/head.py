"""The fused LM head in TRL's model: ``add_fastcov_head`` (the policy's forward returns per-token log-probs and
entropies from the hidden states, no logits) and the MoE router's auxiliary loss on that path."""

from __future__ import annotations

import functools
import sys

import torch

from fastcov.integrations.transformers import (
    FastcovCausalLMOutput,
    decoder_and_head,
    fused_logprob_entropy,
)


def add_fastcov_head(model, temperature: float = 1.0, impl: str = "auto", zero3: bool = False):
    """Give ``model``'s forward a ``fastcov_logits_to_keep=K`` keyword (in place; returns ``model``).

    ``model(input_ids=[B, T], attention_mask=[B, T], fastcov_logits_to_keep=K)`` runs the decoder and returns a
    ``FastcovCausalLMOutput`` whose ``logprob`` / ``entropy`` are [B, K] fp32: log π(input_ids[:, t] | < t) and the
    entropy at that step, for the last K positions t, 0 where attention_mask is 0 — TRL's
    ``_get_per_token_logps_and_entropies`` values. Only the last K + 1 hidden states reach the fused kernel, and the
    logits are never formed. Without the keyword the forward is unchanged (generation, TRL's own fused head).

    ``zero3=True`` (the model is, or will be, partitioned by DeepSpeed ZeRO-3): the fused kernel reads the head's
    weight (and bias) outside the head module's own forward, where ZeRO-3 would leave it partitioned (an empty
    tensor). They are registered as external parameters of ``model`` (``deepspeed.zero.register_external_parameter``),
    so DeepSpeed gathers them whole for the forward of ``model`` and again for its backward, and reduce-scatters
    their gradients like any other parameter's.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the HF model
    _, head = decoder_and_head(base)  # refuse non-Linear heads and logit transforms now, not at the first step
    if zero3:
        from deepspeed.runtime.zero import register_external_parameter

        # on the outermost module: DeepSpeed's engine calls it (PEFT's wrappers call base.forward directly, which
        # fires no hooks of base); a tied head is the input embedding, and stays gathered while model is running
        for param in (head.weight, head.bias):
            if param is not None:
                register_external_parameter(model, param)
    inner = base.forward

    @functools.wraps(inner)
    def forward(*args, fastcov_logits_to_keep=None, **kwargs):
        if fastcov_logits_to_keep is None:
            return inner(*args, **kwargs)
        if args:
            raise TypeError("the fastcov head takes keyword arguments only (input_ids=..., attention_mask=...)")
        keep = int(fastcov_logits_to_keep)
        input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
        if not 0 < keep < input_ids.shape[1]:
            raise ValueError(f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}], got {keep}")
        decoder, head = decoder_and_head(base)  # looked up per call: wrappers may replace the modules
        dropped = ("labels", "return_dict", "output_hidden_states", "output_attentions", "num_items_in_batch")
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in dropped}
        kwargs["use_cache"] = False
        decoded = decoder(**kwargs)
        aux_loss = None
        if kwargs.get("output_router_logits"):  # an MoE model's load-balancing loss over every position, as its own
            aux_loss = router_aux_loss_function(base)(decoded.router_logits, attention_mask)
        hidden = decoded.last_hidden_state[:, -keep - 1:]
        labels = input_ids[:, -keep - 1:].masked_fill(attention_mask[:, -keep - 1:] == 0, -100)
        with torch.autocast(hidden.device.type, enabled=False):
            stats = fused_logprob_entropy(base, hidden.to(head.weight.dtype), labels, temperature=temperature,
                                          impl=impl)
        assert stats.entropy is not None  # computed unless entropy=False
        return FastcovCausalLMOutput(logprob=stats.logprob[:, 1:], entropy=stats.entropy[:, 1:], aux_loss=aux_loss)

    base.forward = forward
    return model


def router_aux_loss_function(model):
    """``f(router_logits, attention_mask) -> aux_loss``: the load-balancing loss ``model`` (an MoE causal LM, unwrapped)
    adds to its own output, from its decoder's router logits: its modeling module's ``load_balancing_loss_func`` with
    its ``num_experts`` and ``num_experts_per_tok``, as transformers' MoE causal LMs compute ``aux_loss``.

    Raises:
        ValueError: naming router_aux_loss_coef, for a model whose aux loss is computed otherwise.
    """
    loss_func = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if loss_func is None or not isinstance(experts, int) or not isinstance(top_k, int):
        raise ValueError(f"router_aux_loss_coef: {type(model).__name__} does not compute its MoE load-balancing loss "
                         "as load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, "
                         "attention_mask), which the fused head reproduces; set router_aux_loss_coef=0")
    return functools.partial(_aux_loss, loss_func, experts, top_k)


def _aux_loss(loss_func, experts, top_k, router_logits, attention_mask):
    return loss_func(router_logits, experts, top_k, attention_mask)
