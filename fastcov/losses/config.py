"""The loss settings (``LossConfig``: every loss hyperparameter's one home) and the selection records
(``Selection``: a mini-batch's selected tokens; ``SelectionInputs``: what a mode's selector reads)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from fastcov.selection import (
    check_band,
    check_ratio,
)

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SCOPES = ("microbatch", "global")
CovScore = Literal["batch", "vocab", "random", "random_matched"]
COV_SCORES: tuple[CovScore, ...] = ("batch", "vocab", "random", "random_matched")
RANDOM_CONTROLS = ("random", "random_matched")


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of every mode and modifier (frozen; use ``dataclasses.replace`` to change).

    clip_low, clip_high: PPO clip range [1 − clip_low, 1 + clip_high] (DAPO clip-higher: clip_high > clip_low).
    dual_clip_c: dual-clip constant c > 1 for A < 0 (None: no dual clip). Applies to vanilla, clip_cov and gspo.
    clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov fraction and open covariance band.
    kl_cov_ratio, kl_cov_coef: KL-Cov fraction and β.
    cispo_clip_max, cispo_clip_min: CISPO's bounds on sg(r) (min None: none); sapo_tau_pos, sapo_tau_neg:
        SAPO's temperatures; vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weight's
        power k and decay λ for A ≥ 0 / A < 0 (fastcov/policy_modes.py).
    entropy_coef: entropy bonus, loss −= entropy_coef · agg(entropy) (needs ``entropy``).
    pos_adv_weight, neg_adv_weight: λ+ / λ−, per-token loss weights where A > 0 / A < 0.
    high_entropy_fraction: train only on this top fraction of valid tokens by entropy (the others
        get zero loss but stay in the denominators); None: all tokens.
    cov_score: "batch" (the paper's c_t), "vocab" (A_t·κ_t, κ = the ``vocab_cov`` input) or "random"
        (the control: uniform scores inside the Clip-Cov band, so Clip-Cov and KL-Cov pick the same
        number of tokens as with c_t, at random; keys hash the global position, as Clip-Cov's do) or
        "random_matched" (the control for Clip-Cov: the mode selects with c_t, then as many tokens as it
        picked are chosen uniformly among all valid tokens instead, not only inside the band).
    loss_scale_factor: divisor of "seq-mean-token-sum-norm" (None: the padded length T of the call;
        set a constant when micro-batches differ in T).
    check_finite: reject non-finite advantages (one host sync per call; trainers that validate
        advantages once per batch can turn it off).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0
    # CISPO's bounds on its stop-gradient IS weight (ε_max: TRL's epsilon_high, verl's 1 + clip_ratio_high;
    # lower: verl's 1 − clip_ratio_low, TRL has none) and SAPO's gate temperatures for A > 0 / A ≤ 0
    cispo_clip_max: float = 5.0
    cispo_clip_min: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # VESPO's gamma weighting φ(w) = exp(λ + k·log w − λ·w) of the sequence ratio w (TRL's vespo_* defaults)
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0
    pos_adv_weight: float = 1.0
    neg_adv_weight: float = 1.0
    high_entropy_fraction: float | None = None
    cov_score: CovScore = "batch"
    loss_scale_factor: float | None = None
    check_finite: bool = True

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "kl_cov_coef", "pos_adv_weight", "neg_adv_weight"):
            value = getattr(self, name)
            _check_real(name, value)
            if value < 0:
                raise ValueError(f"{name} must be ≥ 0, got {value}")
        _check_real("entropy_coef", self.entropy_coef)
        for name in ("cispo_clip_max", "sapo_tau_pos", "sapo_tau_neg") + ("cispo_clip_min",) * (
            self.cispo_clip_min is not None
        ):
            _check_real(name, getattr(self, name))
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            _check_real(name, getattr(self, name))
            if getattr(self, name) < 0 or (name.startswith("vespo_lambda") and getattr(self, name) == 0):
                raise ValueError(f"{name} must be {'> 0' if 'lambda' in name else '≥ 0'}, got {getattr(self, name)}")
        if self.cispo_clip_min is not None and self.cispo_clip_min > self.cispo_clip_max:
            raise ValueError(
                f"cispo_clip_min must be ≤ cispo_clip_max, got {self.cispo_clip_min} > {self.cispo_clip_max}"
            )
        if self.dual_clip_c is not None:
            _check_real("dual_clip_c", self.dual_clip_c)
            if self.dual_clip_c <= 1.0:
                raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        check_ratio(self.clip_cov_ratio, "clip_cov_ratio")
        check_ratio(self.kl_cov_ratio, "kl_cov_ratio")
        check_band(self.clip_cov_lb, self.clip_cov_ub, "clip_cov_lb", "clip_cov_ub")
        if self.high_entropy_fraction is not None:
            check_ratio(self.high_entropy_fraction, "high_entropy_fraction")
        if self.cov_score not in COV_SCORES:
            raise ValueError(f"cov_score must be one of {COV_SCORES}, got {self.cov_score!r}")
        if self.loss_scale_factor is not None:
            _check_real("loss_scale_factor", self.loss_scale_factor)
            if self.loss_scale_factor <= 0:
                raise ValueError(f"loss_scale_factor must be > 0, got {self.loss_scale_factor}")


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


# ---------------------------------------------------------------- selections and the registry


@dataclass(frozen=True)
class Selection:
    """Token selections of one batch; bool [B, T] tensors or None.

    cov: tokens picked by the mode's covariance rule (Clip-Cov: loss zeroed; KL-Cov: KL-penalised).
    high_entropy: tokens kept by ``high_entropy_fraction``.
    reference: with a random control (cov_score "random" / "random_matched"), what the covariance rule
        would have picked on the same tokens (a diagnostic: the overlap metrics); None otherwise.
    """

    cov: torch.Tensor | None = None
    high_entropy: torch.Tensor | None = None
    reference: torch.Tensor | None = None

    def rows(self, index) -> Selection:
        """The selection of a micro-batch: rows ``index`` (slice, int tensor or bool tensor) of each mask."""
        return Selection(*(None if x is None else x[index] for x in (self.cov, self.high_entropy, self.reference)))


@dataclass(frozen=True)
class SelectionInputs:
    """What a mode's selector sees. All tensors [B, T], detached, zero on invalid tokens.

    scores: the selection score (c_t, or A·κ with cov_score="vocab"); keys: int64 random keys from
    the fused covariance kernel or None; valid: bool mask; group: process group for the statistics
    (None in microbatch scope).
    """

    scores: torch.Tensor
    keys: torch.Tensor | None
    logprob: torch.Tensor
    old_logprob: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor
    config: LossConfig
    group: object
    generator: torch.Generator | None
