"""verl: fastcov's losses in verl's policy-loss registry, and a drop-in for verl's fused kernel.

    pip install 'fastcov[verl]'                 # verl itself is installed separately (tested: verl 0.9.1)
    import fastcov.integrations.verl            # registers the losses (also done by verl itself at
                                                # `import verl`, through fastcov's "verl.plugins" entry point)
    actor_rollout_ref.actor.policy_loss.loss_mode=fastcov_kl_cov     # in a verl run's overrides

Registered names and what each equals in verl 0.9.1 (same inputs, same config, one data-parallel rank)::

    fastcov_vanilla             verl's ``vanilla``   (PPO clip + dual clip with clip_ratio_c, log-ratio clamped to ±20)
    fastcov_clip_cov            verl's ``clip_cov``  (PPO clip, no dual clip; random pick in the band)
    fastcov_clip_cov_dual_clip  ``clip_cov`` plus the dual clip with clip_ratio_c on A < 0 (not in verl)
    fastcov_kl_cov              verl's ``kl_cov``    (no PPO clip; β·|log ratio| on the top-k covariance tokens)

They read verl's own actor config (clip_ratio, clip_ratio_low/high, clip_ratio_c, policy_loss.clip_cov_ratio/lb/ub,
kl_cov_ratio, ppo_kl_coef), multiply by ``rollout_is_weights`` when verl passes them, and aggregate with verl's own
``agg_loss`` and ``config.global_batch_info`` (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor), so
every ``loss_agg_mode`` of verl (token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean,
seq-mean-token-sum-norm) and ``loss_scale_factor`` behave exactly as in verl's losses. Metrics carry verl's names
(``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``) with verl's meaning per loss, plus
``actor/fastcov/selected_frac``.

The one deliberate difference: with ``global_batch_info["dp_size"] > 1`` and torch.distributed initialised, the
covariance means, k and the Clip-Cov / KL-Cov selection are computed over all data-parallel ranks (fastcov's
``scope="global"``; the group is ``set_process_group(...)`` or the world), so the selected tokens no longer depend
on the GPU count; verl selects on each rank alone. The selection is still made per call, i.e. per micro-batch.
Clip-Cov's random pick uses torch's default generator (``set_generator`` to give it another); the pick is uniform
like verl's ``randperm``, but the same seed picks different tokens than verl.

``linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)`` has the
signature and outputs of verl's ``verl.utils.kernel.linear_cross_entropy`` — (logprobs, entropy) —
computed by fastcov's kernel, including the vocabulary-parallel case (``dist_process_group``).

Optimal Token Baseline on the fused path. verl 0.9.1's OTB (``algorithm.adv_estimator=optimal_token_baseline``)
needs Σπ² per token (``actor.calculate_sum_pi_squared=true``), which its FSDP engine refuses with
``use_fused_kernels=true`` ("fused kernels do not materialize the full logits"). ``enable_fused_head()`` (or
``FASTCOV_VERL_FUSED_HEAD=1`` in the workers' environment, read when verl imports this module) makes verl's fused
forward of dense text models (``fused_kernels_backend`` triton or torch) fastcov's kernel, which returns Σπ² from
the same pass, soft-capped heads (Gemma 2) included, and lets the FSDP engine hand it on as ``sum_pi_squared``:
OTB then runs with the fused path on. ``fastcov.token_advantages.optimal_token_baseline`` equals verl's
``compute_optimal_token_baseline_advantage`` (tests/integrations_verl/test_otb_verl.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from fastcov.integrations._require import require
from fastcov.losses import LossConfig, compute_global_selection, get_policy_loss
from fastcov.ops import VocabParallel, linear_logprob_entropy

core_algos = require("verl.trainer.ppo.core_algos", "verl", "'fastcov[verl]'")
if not hasattr(core_algos, "agg_loss") or not hasattr(core_algos, "register_policy_loss"):
    raise ImportError(
        "fastcov.integrations.verl needs verl's core_algos.agg_loss and register_policy_loss (verl 0.9.1 is "
        "tested); this verl has not got them"
    )

# registered name -> (fastcov mode, dual clip)
REGISTERED = {
    "fastcov_vanilla": ("vanilla", True),
    "fastcov_clip_cov": ("clip_cov", False),
    "fastcov_clip_cov_dual_clip": ("clip_cov", True),
    "fastcov_kl_cov": ("kl_cov", False),
}

_process_group = None
_generator: torch.Generator | None = None


def set_process_group(group) -> None:
    """The data-parallel group the registered losses select over (default: the world group)."""
    global _process_group
    _process_group = group


def set_generator(generator: torch.Generator | None) -> None:
    """The generator Clip-Cov's random pick draws its seed from (None: torch's default generator)."""
    global _generator
    _generator = generator


def _field(obj, name, default):
    value = getattr(obj, name, None) if obj is not None else None
    return default if value is None else value


def loss_config_from_verl(config, *, dual_clip: bool = False) -> LossConfig:
    """verl's ActorConfig (or anything with its attribute names) → fastcov LossConfig.

    ``dual_clip``: apply verl's ``clip_ratio_c`` (default 3.0) on A < 0 tokens; verl's vanilla loss does,
    its clip_cov does not.
    """
    policy = getattr(config, "policy_loss", None)
    clip = _field(config, "clip_ratio", 0.2)
    return LossConfig(
        clip_low=float(_field(config, "clip_ratio_low", clip)),
        clip_high=float(_field(config, "clip_ratio_high", clip)),
        dual_clip_c=float(_field(config, "clip_ratio_c", 3.0)) if dual_clip else None,
        clip_cov_ratio=float(_field(policy, "clip_cov_ratio", 2e-4)),
        clip_cov_lb=float(_field(policy, "clip_cov_lb", 1.0)),
        clip_cov_ub=float(_field(policy, "clip_cov_ub", 5.0)),
        kl_cov_ratio=float(_field(policy, "kl_cov_ratio", 2e-4)),
        kl_cov_coef=float(_field(policy, "ppo_kl_coef", 1.0)),
        check_finite=False,
    )


def _data_parallel_group(dp_size: int):
    if dp_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return _process_group if _process_group is not None else torch.distributed.group.WORLD


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> float:
    return float(torch.where(valid, values.to(torch.float64), 0.0).sum() / valid.sum().clamp(min=1))


def _verl_loss(name: str, mode: str, dual_clip: bool):
    loss_mode = get_policy_loss(mode)

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        if config is None:
            raise ValueError(f"{name}: config (verl's actor config) is required")
        info = dict(_field(config, "global_batch_info", {}) or {})
        group = _data_parallel_group(int(info.get("dp_size", 1) or 1))
        cfg = loss_config_from_verl(config, dual_clip=dual_clip)
        valid = response_mask.bool()
        zeros = torch.zeros_like(log_prob)
        logprob = torch.where(valid, log_prob, zeros)
        old = torch.where(valid, old_log_prob.detach(), zeros)
        adv = torch.where(valid, advantages.detach(), zeros)
        selected = None
        if loss_mode.selector is not None:
            selected = compute_global_selection(logprob.detach(), old, adv, valid, mode=mode, config=cfg,
                                                group=group, generator=_generator).cov
        token_loss = loss_mode.loss(logprob, old, adv, selected, cfg)
        if rollout_is_weights is not None:
            token_loss = token_loss * rollout_is_weights
        loss = core_algos.agg_loss(loss_mat=token_loss, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **info)
        return loss, _metrics(mode, logprob.detach(), old, adv, valid, cfg, selected)

    loss_fn.__name__ = name
    loss_fn.__doc__ = f"fastcov's {mode} policy loss with verl's policy-loss signature and aggregation."
    return loss_fn


def _metrics(mode, logprob, old, adv, valid, cfg, selected) -> dict[str, float]:
    """verl's metric names with the meaning verl's loss of the same mode gives them."""
    with torch.no_grad():
        log_ratio = logprob - old
        metrics = {}
        if mode == "kl_cov":
            metrics["actor/ppo_kl"] = _masked_mean(log_ratio.abs(), valid)
        else:
            if mode == "vanilla":
                log_ratio = log_ratio.clamp(-20.0, 20.0)
            ratio = torch.exp(log_ratio)
            unclipped = -adv * ratio
            clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
            metrics["actor/ppo_kl"] = _masked_mean(-log_ratio, valid)
            if mode == "vanilla":
                metrics["actor/pg_clipfrac"] = _masked_mean(clipped > unclipped, valid)
            else:  # verl's clip_cov reports the fraction of tokens it selected as pg_clipfrac
                metrics["actor/pg_clipfrac"] = _masked_mean(selected, valid)
            if cfg.dual_clip_c is not None:
                lower = (torch.maximum(unclipped, clipped) > -adv * cfg.dual_clip_c) & (adv < 0)
                metrics["actor/pg_clipfrac_lower"] = _masked_mean(lower, valid)
        if selected is not None:
            metrics["actor/fastcov/selected_frac"] = _masked_mean(selected, valid)
    return metrics


def register_losses() -> list[str]:
    """Add fastcov's losses to verl's POLICY_LOSS_REGISTRY (idempotent); returns their names."""
    for name, (mode, dual_clip) in REGISTERED.items():
        if name not in core_algos.POLICY_LOSS_REGISTRY:
            core_algos.register_policy_loss(name)(_verl_loss(name, mode, dual_clip))
    return list(REGISTERED)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         reduction: str = "none",
                         dist_process_group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's fused-kernel signature: hidden [..., D], weight [V or V_local, D], labels [...] (global ids).

    Returns (logprobs, entropy): logprobs shaped like labels for reduction "none", else their "sum" or
    "mean"; entropy per token. With ``dist_process_group`` the vocabulary is split over its ranks (rank r holds
    rows [r·V_local, (r+1)·V_local)); as with verl's kernel, the gradient of ``hidden`` is then this rank's
    share, which the caller sums over the group.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    # as verl's kernel, each rank's gradient of hidden is its own columns' share (Megatron's sequence-parallel
    # gather sums it in its backward; verl's TP test all-reduces it after the call)
    shard = None if dist_process_group is None else VocabParallel(dist_process_group, reduce_hidden_grad=False)
    stats = linear_logprob_entropy(hidden, weight, labels, temperature=float(temperature), vocab_parallel=shard)
    logprobs, entropy = stats.logprob, stats.entropy
    assert entropy is not None  # computed unless entropy=False
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy


# ---------------------------------------------------------------------------------------- the fused head with Σπ²

FUSED_HEAD_ENV = "FASTCOV_VERL_FUSED_HEAD"
_fused_head_enabled = False


def _output_class():
    from verl.models.transformers.dense_common import CausalLMOutputForPPO

    @dataclass
    class FastcovOutputForPPO(CausalLMOutputForPPO):
        """verl's fused-forward output with Σπ² per token (None unless the engine asked for it)."""

        sum_pi_squared: torch.Tensor | None = None

    return FastcovOutputForPPO


def fused_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                  return_dict=None, cache_position=None, logits_to_keep=0, temperature: float = 1.0,
                  shift_labels=None, fastcov_sum_pi_squared: bool = False, **loss_kwargs):
    """verl's fused forward (``forward_with_triton_backend``'s contract: log-probs and entropy of the next token
    at ``temperature``, labels from ``shift_labels``, else ``labels`` or ``input_ids`` rolled by one) computed by
    fastcov's kernel from the decoder's last hidden state and the head (its bias and soft cap included), plus
    ``sum_pi_squared`` when ``fastcov_sum_pi_squared``."""
    from fastcov.integrations.transformers import logit_softcap

    if not return_dict:
        raise NotImplementedError("fastcov's fused forward has to return_dict (as verl's)")
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                         return_dict=True, cache_position=cache_position)
    if shift_labels is not None:
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise RuntimeError("fastcov's fused forward needs shift_labels, labels or input_ids")
    head = self.get_output_embeddings()
    hidden = outputs[0]
    stats = linear_logprob_entropy(hidden.to(head.weight.dtype), head.weight, rolled, bias=head.bias,
                                   temperature=float(temperature), sum_p2=bool(fastcov_sum_pi_squared),
                                   softcap=logit_softcap(self))
    return _output_class()(log_probs=stats.logprob, entropy=stats.entropy, sum_pi_squared=stats.sum_p2,
                           past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                           attentions=outputs.attentions)


def _wrap_inputs(original):
    @functools.wraps(original)
    def prepare_model_inputs(self, micro_batch):
        from verl.utils import tensordict_utils as tu

        model_inputs, output_args = original(self, micro_batch)
        if (tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False)
                and tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False)):
            model_inputs["fastcov_sum_pi_squared"] = True
        return model_inputs, output_args

    return prepare_model_inputs


def _wrap_outputs(original):
    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        from verl.utils import tensordict_utils as tu

        fused = tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False)
        wanted = tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False)
        if not (fused and wanted):
            return original(self, output, output_args, micro_batch, logits_processor_func)
        if getattr(output, "sum_pi_squared", None) is None:
            raise NotImplementedError("calculate_sum_pi_squared with use_fused_kernels needs fastcov's fused forward "
                                      "(fastcov.integrations.verl.enable_fused_head() before the model is built)")
        tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=False)  # verl's own path: log p and H
        try:
            model_output = original(self, output, output_args, micro_batch, logits_processor_func)
        finally:
            tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=True)
        offsets = micro_batch["input_ids"].offsets()
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            packed = self._gather_and_unpad_packed(output.sum_pi_squared.squeeze(0), output_args["pad_size"])
        else:  # dense (bsz, seqlen): each sequence's own positions, packed as verl packs log p
            width = output.sum_pi_squared.shape[1]
            packed = output.sum_pi_squared[torch.arange(width, device=offsets.device) < offsets.diff()[:, None]]
        model_output["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(packed, offsets)
        return model_output

    return prepare_model_outputs


def enable_fused_head() -> None:
    """Make verl's fused forward (dense text models, ``fused_kernels_backend`` triton or torch) fastcov's
    ``fused_forward`` and let verl's FSDP engine take Σπ² from it with ``use_fused_kernels=true`` (OTB's
    ``calculate_sum_pi_squared``). Idempotent; call it in every worker before the model is built (or set
    FASTCOV_VERL_FUSED_HEAD=1 in their environment). Other models (the VL ones with their own fused forward)
    keep verl's kernel."""
    global _fused_head_enabled
    if _fused_head_enabled:
        return
    from verl.models.transformers import dense_common
    from verl.workers.engine.fsdp import transformer_impl

    dense_common.forward_with_triton_backend = fused_forward
    dense_common.forward_with_torch_backend = fused_forward
    engine = transformer_impl.FSDPEngineWithLMHead
    engine.prepare_model_inputs = _wrap_inputs(engine.prepare_model_inputs)
    engine.prepare_model_outputs = _wrap_outputs(engine.prepare_model_outputs)
    _fused_head_enabled = True


register_losses()
if os.environ.get(FUSED_HEAD_ENV, "0") not in ("", "0"):
    enable_fused_head()
