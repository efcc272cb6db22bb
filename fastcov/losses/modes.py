"""The registry of loss modes and the PPO-clip family: vanilla, Clip-Cov, KL-Cov and KL-Cov's penalty alone,
each a short pure function ``(logprob, old_logprob, advantages, selected, config) -> [B, T]``; Clip-Cov and
KL-Cov register the selector that picks their tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastcov.losses.config import LossConfig, SelectionInputs
from fastcov.registry import Registry
from fastcov.selection import (
    select_random_in_band,
    select_top_covariance,
)

TokenLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", LossConfig], torch.Tensor]
SelectorFn = Callable[[SelectionInputs], torch.Tensor]


@dataclass(frozen=True)
class PolicyLossMode:
    """A registered mode: ``loss(logprob, old_logprob, advantages, selected, config) -> [B, T]`` and
    optionally ``selector(SelectionInputs) -> bool [B, T]`` (``random_keys``: the selector uses the
    fused kernel's random keys; ``sequence_ratio``: the mode's ratio is its sequence's; ``sequence_rows``: the
    function reads each row as one sequence; see ``register``).
    Calling the mode calls ``loss``."""

    name: str
    loss: TokenLossFn
    selector: SelectorFn | None = None
    random_keys: bool = False
    sequence_ratio: bool = False
    sequence_rows: bool = False

    def __call__(self, logprob, old_logprob, advantages, selected, config):
        return self.loss(logprob, old_logprob, advantages, selected, config)


MODES: Registry[PolicyLossMode] = Registry("mode")


def register(
    name: str,
    *,
    selector: SelectorFn | None = None,
    random_keys: bool = False,
    override: bool = False,
    sequence_ratio: bool = False,
    sequence_rows: bool = False,
):
    """Decorator registering a per-token loss function as mode ``name``.

    The function gets sanitized [B, T] tensors (zeros on invalid tokens), ``selected`` (bool [B, T]
    from ``selector``, or None when the mode has no selector) and the ``LossConfig``, and returns the
    per-token loss [B, T]; ``policy_loss`` applies the λ weights, the high-entropy mask, the
    aggregation and the entropy bonus. With ``sequence_ratio`` the function's ``old_logprob`` is
    ``sg(logprob) − sg(mean over the row's valid tokens of (logprob − old_logprob))``, so that
    ``logprob − old_logprob`` is GSPO's token-level sequence log-ratio (one sequence per row). With
    ``sequence_rows`` the function reduces over each row as one sequence (VESPO's sum): given packed rows
    (``policy_loss``'s ``segments``), it is called on their sequences laid out one per row, and its loss put back.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")

    def decorator(loss: TokenLossFn) -> TokenLossFn:
        mode = PolicyLossMode(name, loss, selector, random_keys, sequence_ratio, sequence_rows)
        MODES.add(name, mode, override=override)
        return loss

    return decorator


def get_policy_loss(name: str) -> PolicyLossMode:
    """The registered mode ``name``; ValueError naming ``mode`` if unknown."""
    return MODES.get(name)


def available_modes() -> tuple[str, ...]:
    return MODES.names()


# ---------------------------------------------------------------- the modes


def ppo_clip_terms(ratio: torch.Tensor, advantages: torch.Tensor, config: LossConfig):
    """(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)), both [B, T]."""
    return -advantages * ratio, -advantages * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)


def ppo_clipped(logprob, old_logprob, advantages, config: LossConfig) -> torch.Tensor:
    """bool [B, T]: tokens where PPO's clipped branch is the active one (−A·clip(r) > −A·r)."""
    unclipped, clipped = ppo_clip_terms(torch.exp(logprob - old_logprob), advantages, config)
    return clipped > unclipped


def dual_clip(loss: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """PPO's per-token loss [B, T] with the dual clip: at most −A·dual_clip_c where A < 0 (unchanged without it)."""
    if config.dual_clip_c is None:
        return loss
    return torch.where(advantages < 0, torch.minimum(loss, -advantages * config.dual_clip_c), loss)


def _clip_cov_selector(inputs: SelectionInputs) -> torch.Tensor:
    config = inputs.config
    return select_random_in_band(
        inputs.scores,
        inputs.valid,
        config.clip_cov_ratio,
        config.clip_cov_lb,
        config.clip_cov_ub,
        exclude=ppo_clipped(inputs.logprob, inputs.old_logprob, inputs.advantages, config),
        generator=inputs.generator,
        group=inputs.group,
        keys=inputs.keys,
    )


def _kl_cov_selector(inputs: SelectionInputs) -> torch.Tensor:
    return select_top_covariance(inputs.scores, inputs.valid, inputs.config.kl_cov_ratio, group=inputs.group)


@register("vanilla")
def vanilla_loss(logprob, old_logprob, advantages, selected, config: LossConfig) -> torch.Tensor:
    """PPO/GRPO clip, DAPO clip-higher, optional dual clip. The log-ratio is clamped to ±20 (as verl)."""
    ratio = torch.exp((logprob - old_logprob).clamp(-20.0, 20.0))
    unclipped, clipped = ppo_clip_terms(ratio, advantages, config)
    return dual_clip(torch.maximum(unclipped, clipped), advantages, config)


@register("clip_cov", selector=_clip_cov_selector, random_keys=True)
def clip_cov_loss(logprob, old_logprob, advantages, selected, config: LossConfig) -> torch.Tensor:
    """PPO clip loss with the selected tokens' loss (and gradient) set to 0."""
    unclipped, clipped = ppo_clip_terms(torch.exp(logprob - old_logprob), advantages, config)
    loss = dual_clip(torch.maximum(unclipped, clipped), advantages, config)
    return torch.where(selected, torch.zeros_like(loss), loss)


@register("kl_cov", selector=_kl_cov_selector)
def kl_cov_loss(logprob, old_logprob, advantages, selected, config: LossConfig) -> torch.Tensor:
    """Unclipped policy gradient plus β·|logp − old_logp| on the selected tokens.

    On-policy (one mini-batch and one PPO epoch per rollout batch) logp = old_logp, so the penalty is 0 and this
    is plain policy gradient: KL-Cov needs several optimizer steps per rollout (PRIME-RL/Entropy-Mechanism-of-RL#1).
    """
    log_ratio = logprob - old_logprob
    return -advantages * torch.exp(log_ratio) + config.kl_cov_coef * log_ratio.abs() * selected


@register("kl_cov_penalty", selector=_kl_cov_selector)
def kl_cov_penalty(logprob, old_logprob, advantages, selected, config: LossConfig) -> torch.Tensor:
    """KL-Cov's penalty alone, β·|logp − old_logp| on the selected tokens: added to another mode's loss (CISPO, SAPO,
    VESPO, GSPO: no token clip for Clip-Cov to act inside), it gives that mode KL-Cov's control. The TRL integration
    adds it for fastcov_loss_mode="kl_cov" with those losses. Like KL-Cov, 0 on-policy."""
    return config.kl_cov_coef * (logprob - old_logprob).abs() * selected
