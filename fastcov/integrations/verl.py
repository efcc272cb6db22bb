"""verl: fastcov's losses in verl's policy-loss registry, and a drop-in for verl's fused kernel.

    import fastcov.integrations.verl            # registers the losses (also done by verl itself at
                                                # `import verl`, through fastcov's "verl.plugins" entry point)
    actor_rollout_ref.actor.policy_loss.loss_mode=fastcov_kl_cov     # in a verl run's overrides

Registered names: ``fastcov_vanilla``, ``fastcov_clip_cov``, ``fastcov_kl_cov``. They read verl's own
actor config (clip_ratio_low/high, clip_ratio_c, policy_loss.clip_cov_ratio/lb/ub, kl_cov_ratio,
ppo_kl_coef) and compute the covariance statistics and the selection over all data-parallel ranks
(fastcov's ``scope="global"``), so the selected tokens no longer depend on the GPU count. The
selection is still made per call, i.e. per micro-batch: with gradient accumulation over several
micro-batches it spans one micro-batch on every rank (fastcov's own trainer selects per mini-batch).

``linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)`` has the
signature and outputs of verl's ``verl.utils.kernel.linear_cross_entropy`` — (logprobs, entropy) —
computed by fastcov's kernel, including the vocabulary-parallel case (``dist_process_group``).
"""

from __future__ import annotations

import torch

from fastcov.integrations._require import require
from fastcov.losses import LossConfig, policy_loss
from fastcov.ops import _backend, linear_logprob_entropy

core_algos = require("verl.trainer.ppo.core_algos", "verl", "verl")

REGISTERED = {"fastcov_vanilla": "vanilla", "fastcov_clip_cov": "clip_cov", "fastcov_kl_cov": "kl_cov"}

_process_group = None


def set_process_group(group) -> None:
    """The data-parallel group the registered losses reduce over (default: the world group)."""
    global _process_group
    _process_group = group


def _field(obj, name, default):
    value = getattr(obj, name, None) if obj is not None else None
    return default if value is None else value


def loss_config_from_verl(config) -> LossConfig:
    """verl's ActorConfig (or anything with its attribute names) → fastcov LossConfig."""
    policy = getattr(config, "policy_loss", None)
    clip = _field(config, "clip_ratio", 0.2)
    return LossConfig(
        clip_low=float(_field(config, "clip_ratio_low", clip)),
        clip_high=float(_field(config, "clip_ratio_high", clip)),
        dual_clip_c=_field(config, "clip_ratio_c", None),
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


def _verl_loss(mode: str):
    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        if rollout_is_weights is not None:
            raise NotImplementedError(f"fastcov_{mode}: rollout correction weights are not supported")
        info = dict(_field(config, "global_batch_info", {}) or {})
        dp_size = int(info.get("dp_size", 1))
        group = _data_parallel_group(dp_size)
        global_tokens = info.get("batch_num_tokens")
        if global_tokens is None:
            global_tokens = response_mask.sum() if group is None else None
            if group is not None:
                global_tokens = response_mask.sum().float()
                torch.distributed.all_reduce(global_tokens, group=group)
        global_seqs = info.get("global_batch_size")
        if global_seqs is None and loss_agg_mode.startswith("seq-mean"):
            global_seqs = (response_mask.sum(-1) > 0).sum().float()
            if group is not None:
                torch.distributed.all_reduce(global_seqs, group=group)
        loss, metrics = policy_loss(
            log_prob, old_log_prob, advantages, response_mask, mode=mode, agg=loss_agg_mode, scope="global",
            config=loss_config_from_verl(config), group=group, global_tokens=global_tokens,
            global_seqs=global_seqs,
        )
        # verl's data-parallel engines average gradients over ranks; fastcov's global losses sum them
        scale = dp_size if group is not None else 1
        return loss * scale, {f"actor/{name}": float(value) for name, value in metrics.items()}

    loss_fn.__name__ = f"fastcov_{mode}"
    loss_fn.__doc__ = f"fastcov's {mode} policy loss (global scope) with verl's policy-loss signature."
    return loss_fn


def register_losses() -> list[str]:
    """Add fastcov's losses to verl's POLICY_LOSS_REGISTRY (idempotent); returns their names."""
    for name, mode in REGISTERED.items():
        if name not in core_algos.POLICY_LOSS_REGISTRY:
            core_algos.register_policy_loss(name)(_verl_loss(mode))
    return list(REGISTERED)


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """verl's fused-kernel signature: hidden [..., D], weight [V or V_local, D], labels [...] (global ids).

    Returns (logprobs, entropy): logprobs shaped like labels for reduction "none", else their "sum" or
    "mean"; entropy per token. With ``dist_process_group`` the vocabulary is split over its ranks.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if dist_process_group is None:
        stats = linear_logprob_entropy(hidden, weight, labels, temperature=float(temperature))
        logprobs, entropy = stats.logprob, stats.entropy
    else:
        from fastcov.kernels._autograd import VocabParallelLogprobEntropyFunction

        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        logprobs, entropy, _ = VocabParallelLogprobEntropyFunction.apply(
            hidden2d, weight, labels.reshape(-1).long().contiguous(), float(temperature), -100,
            dist_process_group, _backend("auto", hidden.device),
        )
        logprobs, entropy = logprobs.view(labels.shape), entropy.view(labels.shape)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy


register_losses()
