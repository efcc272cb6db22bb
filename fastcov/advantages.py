"""Outcome-reward advantage estimators (one scalar reward per sequence) and DAPO's group filter.

Every estimator has the signature ``fn(rewards, groups, *, eps=1e-6) -> advantages`` where
``rewards`` is a 1-D float tensor [num_prompts·n] and ``groups`` is either an int n (sequences
of one prompt are contiguous: rows i·n … i·n+n−1) or an integer tensor [num_prompts·n] of group
(prompt) ids in any order. The result is a float tensor [num_prompts·n] of per-sequence
advantages; ``broadcast_to_tokens`` turns it into the [B, T] input of ``policy_loss``.

Singleton groups follow verl: GRPO uses mean 0 and std 1 (advantage r/(1+eps)), Dr.GRPO mean 0,
RLOO the raw reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fastcov.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]
ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def register_advantage(name: str, *, override: bool = False):
    """Decorator registering an advantage estimator under ``name``."""
    return ESTIMATORS.register(name, override=override)


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered as ``name``; ValueError naming it if unknown."""
    return ESTIMATORS.get(name)


def available_advantages() -> tuple[str, ...]:
    return ESTIMATORS.names()


# ---------------------------------------------------------------- helpers


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts*n], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (found NaN or inf)")
    return rewards


def group_index(groups, num_sequences: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Dense group index in [0, num_groups) for every sequence, and num_groups.

    Args:
        groups: int n (contiguous groups of n) or an integer tensor [num_sequences] of ids.
    """
    if isinstance(groups, bool):
        raise TypeError("groups must be an int group size or an integer tensor of group ids, got bool")
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups (group size n) must be ≥ 1, got {groups}")
        if num_sequences % groups:
            raise ValueError(f"groups: {num_sequences} rewards do not split into groups of {groups}")
        index = torch.arange(num_sequences, device=device) // groups
        return index, num_sequences // groups
    if not isinstance(groups, torch.Tensor):
        raise TypeError(f"groups must be an int or a tensor of group ids, got {type(groups).__name__}")
    if groups.shape != (num_sequences,):
        raise ValueError(f"groups has shape {tuple(groups.shape)} but rewards has shape ({num_sequences},)")
    if groups.is_floating_point() or groups.dtype == torch.bool:
        raise TypeError(f"groups must hold integer ids, got {groups.dtype}")
    if groups.device != device:
        raise ValueError(f"groups is on {groups.device} but rewards is on {device}")
    unique, index = torch.unique(groups, return_inverse=True)
    return index, unique.numel()


def _group_stats(rewards: torch.Tensor, groups):
    """Per-sequence (group size, group mean, unbiased group std; std is NaN-free, 0 for singletons)."""
    index, num_groups = group_index(groups, rewards.numel(), rewards.device)
    dtype = torch.float64  # statistics in float64, result cast back
    values = rewards.to(dtype)
    counts = torch.zeros(num_groups, dtype=dtype, device=rewards.device).index_add_(0, index, torch.ones_like(values))
    sums = torch.zeros(num_groups, dtype=dtype, device=rewards.device).index_add_(0, index, values)
    means = sums / counts
    centered = values - means[index]
    sq = torch.zeros(num_groups, dtype=dtype, device=rewards.device).index_add_(0, index, centered * centered)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return counts[index], means[index], std[index]


# ---------------------------------------------------------------- estimators


@register_advantage("grpo")
def grpo(rewards: torch.Tensor, groups, *, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r − mean_g) / (std_g + eps), unbiased group std. Shapes: [N] → [N]."""
    rewards = _check_rewards(rewards)
    size, mean, std = _group_stats(rewards, groups)
    singleton = size == 1
    mean = torch.where(singleton, 0.0, mean)
    std = torch.where(singleton, 1.0, std)
    return ((rewards.to(torch.float64) - mean) / (std + eps)).to(rewards.dtype)


@register_advantage("dr_grpo")
def dr_grpo(rewards: torch.Tensor, groups, *, eps: float = 1e-6) -> torch.Tensor:
    """Dr.GRPO: r − mean_g (no std normalisation). ``eps`` is unused. Shapes: [N] → [N]."""
    rewards = _check_rewards(rewards)
    size, mean, _ = _group_stats(rewards, groups)
    mean = torch.where(size == 1, 0.0, mean)
    return (rewards.to(torch.float64) - mean).to(rewards.dtype)


@register_advantage("rloo")
def rloo(rewards: torch.Tensor, groups, *, eps: float = 1e-6) -> torch.Tensor:
    """RLOO: r_i − mean of the other rewards of its group = n/(n−1)·(r_i − mean_g). ``eps`` unused."""
    rewards = _check_rewards(rewards)
    size, mean, _ = _group_stats(rewards, groups)
    values = rewards.to(torch.float64)
    leave_one_out = size / (size - 1).clamp(min=1) * (values - mean)
    return torch.where(size > 1, leave_one_out, values).to(rewards.dtype)


@register_advantage("reinforce_pp")
def reinforce_pp(
    rewards: torch.Tensor, groups=None, *, eps: float = 1e-6, group_baseline: bool = False
) -> torch.Tensor:
    """REINFORCE++: (r − mean) / (std + eps) over the whole batch (unbiased std).

    With ``group_baseline`` the group mean is subtracted first (REINFORCE++-baseline); ``groups`` is
    only needed then. Normalisation is over sequences (verl whitens over tokens instead).
    """
    rewards = _check_rewards(rewards)
    values = rewards.to(torch.float64)
    if group_baseline:
        if groups is None:
            raise ValueError("groups is required when group_baseline=True")
        _, mean, _ = _group_stats(rewards, groups)
        values = values - mean
    centered = values - values.mean()
    std = centered.std() if values.numel() > 1 else torch.zeros((), dtype=torch.float64, device=values.device)
    return (centered / (std + eps)).to(rewards.dtype)


def dapo_filter(rewards: torch.Tensor, groups) -> torch.Tensor:
    """DAPO dynamic sampling: keep mask dropping the groups whose rewards are all equal.

    Args:
        rewards: float [N]; groups: int n or integer ids [N] (see the module docstring).
    Returns:
        bool [N], True for sequences of groups with at least two distinct rewards.
    """
    rewards = _check_rewards(rewards)
    index, num_groups = group_index(groups, rewards.numel(), rewards.device)
    values = rewards.to(torch.float64)
    group_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=rewards.device)
    group_min = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=rewards.device)
    group_max = group_max.scatter_reduce(0, index, values, reduce="amax")
    group_min = group_min.scatter_reduce(0, index, values, reduce="amin")
    return (group_max > group_min)[index]


def broadcast_to_tokens(sequence_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence advantages → [B, T] per-token advantages, 0 on invalid tokens."""
    if sequence_advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != sequence_advantages.shape[0]:
        raise ValueError(
            f"sequence_advantages must be [B] and mask [B, T], got {tuple(sequence_advantages.shape)} "
            f"and {tuple(mask.shape)}"
        )
    return torch.where(mask.bool(), sequence_advantages[:, None], 0.0).to(sequence_advantages.dtype)


def entropy_advantage(advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor | None = None, *,
                      alpha: float, kappa: float) -> torch.Tensor:
    """Cheng et al. 2025's entropy-based advantage shaping (arXiv 2506.14758), per token:

        A_t ← A_t + min(α · H_t, |A_t| / κ)      (H_t detached: no gradient flows through the bonus)

    The bonus is ≥ 0 and, with κ > 1, never flips the sign of a negative advantage; it vanishes where A_t = 0.

    Args:
        advantages: [B, T] float per-token advantages (``broadcast_to_tokens`` of sequence advantages).
        entropy: [B, T] float token entropies H_t (nats), e.g. ``linear_logprob_entropy``'s; detached here.
        mask: optional [B, T] bool or 0/1, valid tokens; invalid tokens get 0.
        alpha: α ≥ 0 (0 returns the advantages unchanged).
        kappa: κ > 0 (the paper uses κ > 1).

    Returns:
        [B, T] tensor of ``advantages``' dtype.

    Raises:
        ValueError: shapes that differ, or α / κ out of range (naming them).
    """
    for name, value in (("alpha", alpha), ("kappa", kappa)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if kappa <= 0:
        raise ValueError(f"kappa must be > 0, got {kappa}")
    if not isinstance(advantages, torch.Tensor) or not isinstance(entropy, torch.Tensor):
        raise TypeError("advantages and entropy must be torch.Tensors")
    if entropy.shape != advantages.shape or (mask is not None and mask.shape != advantages.shape):
        raise ValueError(f"advantages, entropy and mask must have one shape, got {tuple(advantages.shape)}, "
                         f"{tuple(entropy.shape)} and {None if mask is None else tuple(mask.shape)}")
    bonus = torch.minimum(alpha * entropy.detach().to(advantages.dtype), advantages.abs() / kappa)
    shaped = advantages + bonus
    return shaped if mask is None else torch.where(mask.bool(), shaped, torch.zeros_like(shaped))


__all__ = [
    "available_advantages",
    "broadcast_to_tokens",
    "dapo_filter",
    "dr_grpo",
    "entropy_advantage",
    "get_advantage",
    "group_index",
    "grpo",
    "register_advantage",
    "reinforce_pp",
    "rloo",
]
