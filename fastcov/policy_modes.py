"""CISPO, GSPO, SAPO and VESPO: policy-loss modes beside vanilla / Clip-Cov / KL-Cov, in the same registry.

Per token, r = exp(logp − old_logp) (exponent bounded to ±20, as verl), sg = stop-gradient:

    cispo  ℓ = −sg(clip(r, cispo_clip_min, cispo_clip_max)) · A · logp        (MiniMax-M1; gradient sg(w)·A·∇logp)
    gspo   s = exp(sg(mean_t(logp − old_logp)) + logp − sg(logp)),  exponent capped at 10 (as verl);
           ℓ = max(−A·s, −A·clip(s, 1 − clip_low, 1 + clip_high))     (Qwen's GSPO, token form; a sequence per row)
    sapo   τ = sapo_tau_pos if A > 0 else sapo_tau_neg;  ℓ = −A · σ(τ·(r − 1)) · 4/τ   (Qwen's SAPO)
    cispo_seq, sapo_seq   cispo / sapo with GSPO's sequence ratio s in place of r (TRL's loss_type cispo / sapo with
           importance_sampling_level="sequence"): CISPO's weight is sg(clip(s)), SAPO's gate σ(τ·(s − 1))
    vespo  log w = clamp(Σ_t clamp(logp − old_logp, ±20), log 1e-8, 20)  (the row's sequence log-ratio, a sum);
           k, λ = vespo_k_pos, vespo_lambda_pos if A ≥ 0 else vespo_k_neg, vespo_lambda_neg;
           ℓ = −sg(exp(λ + k·log w − λ·w)) · A · logp   (VESPO's gamma weight, 1 at w = 1; a sequence per row)

``policy_loss`` applies to them what it applies to every mode: λ± weights, the high-entropy mask, the rollout
correction's ``weights``, the aggregation and the entropy bonus. They select no tokens: Clip-Cov (a selection inside
PPO's token clip) is not combined with them, while KL-Cov's control is their loss plus mode ``kl_cov_penalty``'s (the
TRL integration's fastcov_loss_mode="kl_cov" with them). ``dual_clip_c`` applies to gspo (PPO's clip on the sequence
ratio, TRL's ``delta``), not to the others (the trainer refuses it with them in one line). The sequence modes read a
row as one sequence, or with packed rows each sequence (``policy_loss``'s ``segments``). Registered on
``import fastcov``. docs/design.md §4.
"""

from __future__ import annotations

import math

import torch

from fastcov.correction import EXP_BOUND, bounded_exp
from fastcov.losses import LossConfig, dual_clip, ppo_clip_terms, register

GSPO_LOG_RATIO_CAP = 10.0
VESPO_LOG_W_MIN = math.log(1e-8)  # VESPO's reference code clamps w at 1e-8 from below


@register("cispo")
def cispo_loss(logprob, old_logprob, advantages, selected, config: LossConfig) -> torch.Tensor:
    """−sg(clip(r, cispo_clip_min, cispo_clip_max))·A·logp: every token keeps a gradient, scaled by a bounded weight."""
    weight = bounded_exp(logprob.detach() - old_logprob).clamp(min=config.cispo_clip_min, max=config.cispo_clip_max)
    return -weight * advantages * logprob


@register("gspo", sequence_ratio=True)
def gspo_loss(logprob, old_logprob, advantages, selected, config: LossConfig) -> torch.Tensor:
    """PPO clip on the sequence ratio s (``old_logprob`` arrives as the sequence form, see ``register``), and the dual
    clip (``dual_clip_c``: the loss of A < 0 at most −A·c, TRL's ``delta``) on it."""
    ratio = torch.exp((logprob - old_logprob).clamp(max=GSPO_LOG_RATIO_CAP))
    unclipped, clipped = ppo_clip_terms(ratio, advantages, config)
    return dual_clip(torch.maximum(unclipped, clipped), advantages, config)


@register("sapo")
def sapo_loss(logprob, old_logprob, advantages, selected, config: LossConfig) -> torch.Tensor:
    """−A·σ(τ(r − 1))·4/τ: a smooth gate in place of the clip, sharper (τ_neg > τ_pos) for A ≤ 0."""
    ratio = bounded_exp(logprob - old_logprob)
    tau = torch.where(advantages > 0, config.sapo_tau_pos, config.sapo_tau_neg).to(ratio.dtype)
    return -advantages * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


# TRL's cispo / sapo at importance_sampling_level="sequence": the same functions on GSPO's sequence ratio
register("cispo_seq", sequence_ratio=True)(cispo_loss)
register("sapo_seq", sequence_ratio=True)(sapo_loss)


@register("vespo", sequence_rows=True)
def vespo_loss(logprob, old_logprob, advantages, selected, config: LossConfig) -> torch.Tensor:
    """−sg(φ(w))·A·logp with φ(w) = exp(λ + k·log w − λ·w), w the row's summed sequence ratio (bounded)."""
    with torch.no_grad():
        log_ratio = (logprob.detach() - old_logprob).clamp(-EXP_BOUND, EXP_BOUND)
        log_w = log_ratio.sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, EXP_BOUND)
        nonneg = advantages >= 0
        k = torch.where(nonneg, config.vespo_k_pos, config.vespo_k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg).to(log_w.dtype)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi.to(logprob.dtype) * advantages * logprob


__all__ = ["cispo_loss", "gspo_loss", "sapo_loss", "vespo_loss"]
