"""Policy-gradient losses with entropy control: vanilla PPO/GRPO/DAPO clip, Clip-Cov and KL-Cov.

Per token (r = exp(logp − old_logp); the formulas of docs/design.md §4)::

    vanilla   ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),  optionally min(ℓ, −A·c) where A < 0
    clip_cov  ℓ = vanilla ℓ · (1 − sel),  sel = min(k, #candidates) random tokens with lb < c_t < ub
              among valid tokens PPO did not already clip
    kl_cov    ℓ = −A·r + β·|logp − old_logp|·sel,  sel = the k tokens with the largest c_t
    kl_cov_penalty  ℓ = β·|logp − old_logp|·sel (KL-Cov's penalty alone, to add to another mode's loss)
    k = max(1, ⌊ratio · n_valid⌋)

Modes are short pure functions ``(logprob, old_logprob, advantages, selected, config) -> [B, T]``
kept in a registry; a mode that needs selected tokens registers a selector with it. Users add modes
with ``@fastcov.losses.register("name")``.

Scope. ``scope="microbatch"`` computes the covariance means, k and the selection inside the call,
on this rank only, like verl 0.9.1 ``loss_mode=clip_cov|kl_cov``. ``scope="global"`` computes them
over the whole mini-batch and every rank of ``group``: either in the call itself (when each rank
passes its whole mini-batch in one call) or, for gradient accumulation over micro-batches, once per
mini-batch with ``compute_global_selection`` whose ``Selection.rows(...)`` slices are passed to each
micro-batch call as ``selection=``. The aggregation divides by the mini-batch totals
``global_tokens`` / ``global_seqs``, so the gradients of all micro-batch calls on all ranks *sum* to
the gradient of one unsplit call. (A data-parallel wrapper that averages gradients over ranks needs
the loss multiplied by the world size, as verl does with ``dp_size``.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from fastcov.covariance import IMPLS, token_covariance, token_covariance_and_keys
from fastcov.registry import Registry
from fastcov.selection import (
    check_band,
    check_like,
    check_ratio,
    decorrelated_keys,
    draw_seed,
    select_random_in_band,
    select_random_matched,
    select_top_covariance,
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


# ---------------------------------------------------------------- aggregation


def _check_agg(agg: str) -> None:
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")


def _denominator(total, fallback: torch.Tensor, name: str, like: torch.Tensor):
    """A divisor ≥ 1: ``total`` (python number or tensor) if given, else ``fallback`` (a local count)."""
    if total is None:
        return fallback.to(like.dtype).clamp(min=1.0)
    if isinstance(total, torch.Tensor):
        if total.numel() != 1:
            raise ValueError(f"{name} must hold one number, got shape {tuple(total.shape)}")
        return total.reshape(()).to(device=like.device, dtype=like.dtype).clamp(min=1.0)
    if isinstance(total, bool) or not isinstance(total, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(total).__name__}")
    if not total >= 0:
        raise ValueError(f"{name} must be ≥ 0, got {total}")
    return float(max(total, 1))


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    *,
    global_tokens=None,
    global_seqs=None,
    loss_scale_factor: float | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token [B, T] matrix to a scalar (verl's aggregation names).

    token-mean:              Σ_valid v / N_tokens
    seq-mean-token-sum:      Σ_seq (Σ_t v) / N_seqs
    seq-mean-token-mean:     Σ_seq (Σ_t v / n_t) / N_seqs
    seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (default T = mask.shape[-1])

    N_tokens = ``global_tokens`` or the local valid count; N_seqs = ``global_seqs`` or the local
    count of sequences with ≥ 1 valid token (denominators are clamped to ≥ 1, so an all-masked
    batch gives 0). Values on invalid tokens are ignored, even if non-finite. ``segments`` (int [B, T], packed
    rows): the valid tokens of a row with the same id are one sequence (None: a sequence per row).
    """
    _check_agg(agg)
    valid = mask.bool()
    masked = torch.where(valid, values, torch.zeros_like(values))
    if agg == "token-mean":
        return masked.sum() / _denominator(global_tokens, valid.sum(), "global_tokens", values)
    if segments is None:
        tokens_per_seq = valid.sum(dim=-1)
        seq_values = masked.sum(dim=-1)
    else:
        index, count = segment_index(valid, segments)
        tokens_per_seq = torch.zeros(count, dtype=torch.long, device=values.device).index_add_(
            0, index[valid], torch.ones_like(index[valid]))
        seq_values = torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(
            0, index[valid], masked[valid])
    if agg == "seq-mean-token-mean":
        seq_values = seq_values / tokens_per_seq.clamp(min=1).to(values.dtype)
    loss = seq_values.sum() / _denominator(global_seqs, (tokens_per_seq > 0).sum(), "global_seqs", values)
    if agg == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else mask.shape[-1])
    return loss


def segment_index(valid: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(index int64 [B, T], count): each valid token's sequence as 0 .. count − 1, sequences being a row's tokens
    with one id of ``segments`` (int [B, T], packed rows); invalid tokens get index 0 and must be masked out."""
    if not isinstance(segments, torch.Tensor) or segments.shape != valid.shape or segments.is_floating_point():
        got = f"{getattr(segments, 'dtype', type(segments).__name__)} {tuple(getattr(segments, 'shape', ()))}"
        raise ValueError(f"segments must be an integer tensor of the mask's shape {tuple(valid.shape)}, got {got}")
    rows = torch.arange(valid.shape[0], device=valid.device)[:, None].expand_as(segments)
    keys = torch.stack([rows[valid], segments[valid].long()], dim=-1)
    index = torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
    if keys.numel() == 0:
        return index, 1
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    index[valid] = inverse
    return index, int(unique.shape[0])


# ---------------------------------------------------------------- checks


def _check_loss_inputs(logprob, old_logprob, advantages, mask, entropy, vocab_cov) -> None:
    if not isinstance(logprob, torch.Tensor):
        raise TypeError(f"logprob must be a torch.Tensor, got {type(logprob).__name__}")
    if logprob.dim() != 2:
        raise ValueError(f"logprob must be [B, T], got shape {tuple(logprob.shape)}")
    if not logprob.is_floating_point():
        raise TypeError(f"logprob must be a floating tensor, got {logprob.dtype}")
    for name, tensor in (
        ("old_logprob", old_logprob),
        ("advantages", advantages),
        ("mask", mask),
        ("entropy", entropy),
        ("vocab_cov", vocab_cov),
    ):
        if name in ("old_logprob", "advantages", "mask") and tensor is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")
        check_like(name, tensor, logprob, "logprob")
        if tensor is not None and name != "mask" and not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {tensor.dtype}")


def _check_finite_advantages(advantages: torch.Tensor, valid: torch.Tensor) -> None:
    if not bool(torch.isfinite(torch.where(valid, advantages, torch.zeros_like(advantages))).all()):
        raise ValueError("advantages must be finite on valid tokens (found NaN or inf)")


def _check_selection_mask(name: str, tensor, logprob: torch.Tensor) -> None:
    check_like(name, tensor, logprob, "logprob")
    if tensor is not None and tensor.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {tensor.dtype}")


# ---------------------------------------------------------------- selection


def _selection_scores(mode, logprob, advantages, valid, config, vocab_cov, group, generator, impl):
    """(scores, keys) for a mode's selector; logprob and advantages are detached and sanitized."""
    if config.cov_score == "random":
        random_seed = draw_seed(generator, logprob.device, group)
        _, keys = token_covariance_and_keys(logprob, advantages, valid, seed=random_seed, group=group, impl=impl)
        assert keys is not None  # a seed gives keys
        # 53 random bits of the key -> u in (0, 1), strictly inside the band (lb, ub)
        u = ((keys & ((1 << 53) - 1)).to(torch.float64) + 0.5) / float(1 << 53)
        lo, hi = config.clip_cov_lb, config.clip_cov_ub
        scores = torch.where(valid, (lo + (hi - lo) * u).to(logprob.dtype), torch.zeros_like(logprob))
        return scores, keys
    if config.cov_score == "vocab":
        if vocab_cov is None:
            raise ValueError("vocab_cov is required when cov_score='vocab'")
        scores = torch.where(valid, advantages * vocab_cov.detach(), torch.zeros_like(advantages))
        return scores, None
    needs_keys = mode.random_keys or config.cov_score == "random_matched"
    seed = draw_seed(generator, logprob.device, group) if needs_keys else None
    return token_covariance_and_keys(logprob, advantages, valid, seed=seed, group=group, impl=impl)


def _select_tokens(mode, logprob, old_logprob, advantages, valid, config, entropy, vocab_cov, group, generator,
                   impl) -> tuple[Selection, torch.Tensor | None]:
    """(Selection, scores or None) over this call's tokens and, with ``group``, all its ranks."""
    scores = cov_selected = reference = None
    if mode.selector is not None:
        scores, keys = _selection_scores(mode, logprob, advantages, valid, config, vocab_cov, group, generator, impl)
        inputs = SelectionInputs(scores, keys, logprob, old_logprob, advantages, valid, config, group, generator)
        cov_selected = mode.selector(inputs) & valid
        if config.cov_score in RANDOM_CONTROLS:
            cov_selected, reference = _random_control(mode, inputs, cov_selected, impl)
    high_entropy = None
    if config.high_entropy_fraction is not None:
        if entropy is None:
            raise ValueError("entropy is required when high_entropy_fraction is set")
        high_entropy = select_top_covariance(entropy.detach(), valid, config.high_entropy_fraction, group=group)
    return Selection(cov_selected, high_entropy, reference), scores


def _random_control(mode, inputs: SelectionInputs, picked: torch.Tensor, impl: str):
    """(the control's selection, what the covariance rule picks on the same tokens) of a random control.

    "random_matched": ``picked`` is the rule's own pick (scores c_t); the control takes as many tokens
    uniformly among all valid ones. "random": ``picked`` already is the control (random scores); the
    rule is re-run on c_t for the overlap diagnostic. Either way the second pick re-hashes the keys, so
    the two sets are independent draws of one seed, and no random number is drawn here.
    """
    keys = None if inputs.keys is None else decorrelated_keys(inputs.keys)
    if inputs.config.cov_score == "random_matched":
        assert keys is not None  # _selection_scores draws them for this score
        return select_random_matched(picked, inputs.valid, keys, group=inputs.group) & inputs.valid, picked
    c_t = token_covariance(inputs.logprob, inputs.advantages, inputs.valid, group=inputs.group, impl=impl)
    return picked, mode.selector(replace(inputs, scores=c_t, keys=keys)) & inputs.valid


def _sanitize(tensor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # Padding may hold garbage (inf, NaN); zero it before any arithmetic so neither the loss nor
    # its gradient can pick it up (a torch.where after exp() would still back-propagate 0·inf).
    return torch.where(valid, tensor, torch.zeros_like(tensor))


def compute_global_selection(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    config: LossConfig = LossConfig(),
    entropy: torch.Tensor | None = None,
    vocab_cov: torch.Tensor | None = None,
    group=None,
    generator: torch.Generator | None = None,
    impl: str = "auto",
) -> Selection:
    """Covariance statistics and token selection of a whole mini-batch (this rank's part), once.

    Call it before the micro-batch loop with the mini-batch's *current* log-probs (a no-grad
    forward; on the first mini-batch of a rollout they equal ``old_logprob``), then pass
    ``selection.rows(rows_of_microbatch)`` as ``selection=`` to each
    ``policy_loss(..., scope="global")`` call. With ``group`` the means, k and the selection cover all
    ranks' mini-batches (every rank must call it, with the same ``mode`` and ``config``).

    Args:
        logprob: floating [B, T].
        old_logprob: floating [B, T].
        advantages: floating [B, T].
        mask: [B, T] (nonzero = valid).
        entropy: [B, T], needed when ``config.high_entropy_fraction`` is set.
        vocab_cov: [B, T] κ, needed when ``config.cov_score == "vocab"``.
        generator: seed source for Clip-Cov (group rank 0's draw is broadcast).
    Returns:
        Selection with bool [B, T] masks (``cov`` None for modes without a selector).
    """
    loss_mode = get_policy_loss(mode)
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    _check_loss_inputs(logprob, old_logprob, advantages, mask, entropy, vocab_cov)
    with torch.no_grad():
        valid = mask.bool()
        selection, _ = _select_tokens(
            loss_mode,
            _sanitize(logprob.detach(), valid),
            _sanitize(old_logprob.detach(), valid),
            _sanitize(advantages.detach(), valid),
            valid,
            config,
            None if entropy is None else _sanitize(entropy.detach(), valid),
            None if vocab_cov is None else _sanitize(vocab_cov.detach(), valid),
            group,
            generator,
            impl,
        )
    return selection


# ---------------------------------------------------------------- the loss


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    agg: str = "token-mean",
    scope: str = "microbatch",
    config: LossConfig = LossConfig(),
    entropy: torch.Tensor | None = None,
    vocab_cov: torch.Tensor | None = None,
    group=None,
    global_tokens=None,
    global_seqs=None,
    generator: torch.Generator | None = None,
    selection: Selection | torch.Tensor | None = None,
    impl: str = "auto",
    weights: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss of one (micro-)batch with Clip-Cov / KL-Cov / vanilla clipping and modifiers.

    Args:
        logprob: [B, T] float, log-probs of the sampled tokens under the current policy (with grad).
        old_logprob: [B, T] float, under the rollout/old policy.
        advantages: [B, T] float, per-token advantages, finite on valid tokens (checked with the
            call's only host sync unless ``config.check_finite`` is False).
        mask: [B, T] bool or 0/1, valid (response, non-padding) tokens.
        mode: a registered mode: "vanilla", "clip_cov", "kl_cov" or a user's. KL-Cov's penalty
            β·|logp − old_logp| is 0 where ``logprob`` equals ``old_logprob`` (on-policy: the first update of a
            rollout batch, and every update with one mini-batch and one PPO epoch), so there it does nothing.
        agg: "token-mean" | "seq-mean-token-sum" | "seq-mean-token-mean" | "seq-mean-token-sum-norm".
        scope: "microbatch" (statistics and selection inside this call on this rank, verl 0.9.1)
            or "global" (over the mini-batch and the ranks of ``group``; see the module docstring).
        config: LossConfig.
        entropy: [B, T] float token entropies (with grad for the bonus); needed for entropy_coef ≠ 0
            and high_entropy_fraction.
        vocab_cov: [B, T] float κ (vocabulary covariance), needed for cov_score="vocab".
        group: process group for scope="global" (ignored in microbatch scope).
        global_tokens: total valid tokens of the mini-batch over all ranks (token-mean denominator);
            required in global scope for token-mean; optional in microbatch scope (verl's
            ``batch_num_tokens``).
        global_seqs: number of sequences with ≥ 1 valid token in the mini-batch over all ranks
            (denominator of the seq-* aggregations); required for those in global scope.
        generator: seed source of Clip-Cov's random selection.
        selection: precomputed ``Selection`` (or a bool [B, T] tensor for ``Selection.cov``), e.g.
            ``compute_global_selection(...).rows(rows)``. Skips computing it here. Without it, a
            global-scope call selects over *this call's* tokens (on all ranks of ``group``): that is
            the mini-batch selection only when each rank passes its whole mini-batch in one call.
            With gradient accumulation over several micro-batches, pass the precomputed selection.
        impl: covariance backend, "auto" | "triton" | "torch".
        weights: floating [B, T] per-token loss weights without gradient, e.g. the rollout correction's
            (``fastcov.rollout_correction``, fastcov/correction.py); they multiply the mode's per-token loss
            after the selection (which they do not change) and before the aggregation; the entropy bonus is
            not weighted.
        segments: int [B, T] for packed rows (several sequences per row): a row's valid tokens with one id are
            one sequence, for the seq-* aggregations and the sequence ratio of GSPO / cispo_seq / sapo_seq (None:
            a sequence per row); a mode registered with ``sequence_rows`` (VESPO) gets one sequence per row. Where
            they are read (those modes, the seq-* aggregations) they cost a host sync (the number of sequences).

    Returns:
        (loss, metrics). loss: 0-dim tensor of logprob's dtype; an all-masked batch gives 0 with a
        (zero) gradient. metrics: detached 0-dim tensors (no host sync), over this call's valid
        tokens: ppo_kl (mean old_logp − logp), clipfrac (PPO clip active), selected_frac
        (covariance selection), cov_mean / cov_max (of the selection score: c_t or A·κ; in global
        scope with a precomputed selection, c_t with this call's means), pos_adv_frac,
        neg_adv_frac, entropy (mean, when given), high_entropy_frac (when configured), empty
        (1.0 when no token is valid, else 0.0) and, with a random control (``selection.reference``),
        selected_and_ref / selected_or_ref (shares of the tokens in both / either of the control and the
        covariance rule's pick: their ratio is the Jaccard overlap).
    """
    loss_mode = get_policy_loss(mode)
    _check_agg(agg)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    _check_loss_inputs(logprob, old_logprob, advantages, mask, entropy, vocab_cov)
    if scope == "global":
        if agg == "token-mean" and global_tokens is None:
            raise ValueError("global_tokens is required for scope='global' with agg='token-mean'")
        if agg != "token-mean" and global_seqs is None:
            raise ValueError(f"global_seqs is required for scope='global' with agg={agg!r}")
    if config.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy is required when entropy_coef != 0")

    valid = mask.bool()
    if config.check_finite:
        _check_finite_advantages(advantages, valid)
    logprob = _sanitize(logprob, valid)
    old_logprob = _sanitize(old_logprob.detach(), valid)
    advantages = _sanitize(advantages.detach(), valid)
    if entropy is not None:
        entropy = _sanitize(entropy, valid)
    if vocab_cov is not None:
        vocab_cov = _sanitize(vocab_cov.detach(), valid)
    stats_group = group if scope == "global" else None

    scores = None
    if selection is None:
        with torch.no_grad():
            selection, scores = _select_tokens(
                loss_mode, logprob.detach(), old_logprob, advantages, valid, config,
                entropy, vocab_cov, stats_group, generator, impl,
            )  # fmt: skip
    else:
        selection = _coerce_selection(selection, loss_mode, config, logprob, valid, entropy, scope)

    selected = selection.cov
    if loss_mode.selector is not None and selected is None:
        raise ValueError(f"selection.cov is required for mode {loss_mode.name!r}")
    mode_old_logprob = old_logprob
    if loss_mode.sequence_ratio:
        mode_old_logprob = _sequence_old_logprob(logprob, old_logprob, valid, segments)
    if segments is not None and loss_mode.sequence_rows:
        token_loss = _per_sequence_rows(loss_mode, logprob, mode_old_logprob, advantages, selected, config, valid,
                                        segments)
    else:
        token_loss = loss_mode(logprob, mode_old_logprob, advantages, selected, config)
    if weights is not None:
        token_loss = token_loss * _sanitize(_checked_weights(weights, logprob), valid)
    if config.pos_adv_weight != 1.0 or config.neg_adv_weight != 1.0:
        ones = torch.ones_like(token_loss)
        weights = torch.where(advantages < 0, ones * config.neg_adv_weight, ones)
        token_loss = token_loss * torch.where(advantages > 0, ones * config.pos_adv_weight, weights)
    if selection.high_entropy is not None:
        token_loss = torch.where(selection.high_entropy, token_loss, torch.zeros_like(token_loss))

    aggregate = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=config.loss_scale_factor,
                     segments=segments)
    loss = aggregate_loss(token_loss, valid, agg, **aggregate)
    if config.entropy_coef != 0.0:
        assert entropy is not None  # checked on entry
        loss = loss - config.entropy_coef * aggregate_loss(entropy, valid, agg, **aggregate)

    metrics = _metrics(
        logprob, old_logprob, advantages, valid, config, selection, scores, entropy, vocab_cov, impl
    )
    return loss, metrics


def _per_sequence_rows(loss_mode, logprob, old_logprob, advantages, selected, config, valid, segments):
    """``loss_mode`` on packed rows' sequences laid out one per row (zero-padded), its loss put back in place."""
    index, count = segment_index(valid, segments)
    flat = index[valid]
    order = torch.argsort(flat, stable=True)  # row-major order within each sequence
    lengths = torch.bincount(flat, minlength=count)
    starts = lengths.cumsum(0) - lengths
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    width = max(int(lengths.max()) if flat.numel() else 1, 1)

    def unpack(x):
        if x is None:
            return None
        out = torch.zeros((count, width), dtype=x.dtype, device=x.device)
        out[flat, pos] = x[valid]
        return out

    rows_loss = loss_mode(unpack(logprob), unpack(old_logprob), unpack(advantages), unpack(selected), config)
    token_loss = torch.zeros_like(logprob)
    token_loss[valid] = rows_loss[flat, pos].to(logprob.dtype)
    return token_loss


def _sequence_old_logprob(logprob, old_logprob, valid, segments=None) -> torch.Tensor:
    """sg(logprob) − sg(sequence mean of logprob − old_logprob over its valid tokens): a mode's ``old_logprob`` with
    ``sequence_ratio`` (see ``register``); a sequence is a row, or a segment of one (``segments``)."""
    with torch.no_grad():
        log_ratio = torch.where(valid, logprob.detach() - old_logprob, torch.zeros_like(old_logprob))
        if segments is None:
            mean = log_ratio.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        else:
            index, count = segment_index(valid, segments)
            sums = torch.zeros(count, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(
                0, index[valid], log_ratio[valid])
            counts = torch.zeros(count, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(
                0, index[valid], torch.ones_like(log_ratio[valid]))
            mean = (sums / counts.clamp(min=1.0))[index]
        return torch.where(valid, logprob.detach() - mean, torch.zeros_like(old_logprob))


def _checked_weights(weights, logprob: torch.Tensor) -> torch.Tensor:
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        raise TypeError(f"weights must be a floating tensor, got {getattr(weights, 'dtype', type(weights).__name__)}")
    if weights.shape != logprob.shape:
        raise ValueError(f"weights must have logprob's shape {tuple(logprob.shape)}, got {tuple(weights.shape)}")
    return weights.detach().to(logprob.dtype)


def _coerce_selection(selection, loss_mode, config, logprob, valid, entropy, scope) -> Selection:
    if isinstance(selection, torch.Tensor):
        selection = Selection(cov=selection)
    if not isinstance(selection, Selection):
        raise TypeError(f"selection must be a Selection or a bool tensor, got {type(selection).__name__}")
    _check_selection_mask("selection.cov", selection.cov, logprob)
    _check_selection_mask("selection.high_entropy", selection.high_entropy, logprob)
    _check_selection_mask("selection.reference", selection.reference, logprob)
    high_entropy = selection.high_entropy
    if config.high_entropy_fraction is not None and high_entropy is None:
        if scope == "global":
            raise ValueError(
                "selection.high_entropy is required with scope='global' and high_entropy_fraction set "
                "(compute_global_selection provides it)"
            )
        if entropy is None:
            raise ValueError("entropy is required when high_entropy_fraction is set")
        high_entropy = select_top_covariance(entropy.detach(), valid, config.high_entropy_fraction)
    cov, reference = (None if x is None else x & valid for x in (selection.cov, selection.reference))
    return Selection(cov, None if high_entropy is None else high_entropy & valid, reference)


def _metrics(logprob, old_logprob, advantages, valid, config, selection, scores, entropy, vocab_cov, impl):
    with torch.no_grad():
        dtype = logprob.dtype
        n_valid = valid.sum()
        denominator = n_valid.clamp(min=1).to(dtype)

        def valid_mean(values: torch.Tensor) -> torch.Tensor:
            return torch.where(valid, values.to(dtype), 0.0).sum() / denominator

        log_ratio = logprob.detach() - old_logprob
        unclipped, clipped = ppo_clip_terms(torch.exp(log_ratio), advantages, config)
        if scores is None and config.cov_score == "vocab" and vocab_cov is not None:
            scores = advantages * vocab_cov
        if scores is None or config.cov_score == "random":  # the diagnostics report the real c_t
            scores = token_covariance(logprob.detach(), advantages, valid, impl=impl)
        zero = torch.zeros((), dtype=dtype, device=logprob.device)
        if valid.numel() > 0:
            cov_max = torch.where(valid, scores.to(dtype), -math.inf).amax()
            cov_max = torch.where(n_valid > 0, cov_max, zero)
        else:
            cov_max = zero
        metrics = {
            "ppo_kl": valid_mean(-log_ratio),
            "clipfrac": valid_mean(clipped > unclipped),
            "selected_frac": zero if selection.cov is None else valid_mean(selection.cov),
            # which tokens the selection acts on, as shares of all tokens (divide by selected_frac):
            # advantage sign, probability exp(logp) and score (c_t or A·κ) of the selected ones
            "selected_pos_adv": zero if selection.cov is None else valid_mean(selection.cov & (advantages > 0)),
            "selected_prob": zero if selection.cov is None else valid_mean(selection.cov * logprob.detach().exp()),
            "selected_cov": zero if selection.cov is None else valid_mean(selection.cov * scores),
            "cov_mean": valid_mean(scores),
            "cov_max": cov_max,
            "pos_adv_frac": valid_mean(advantages > 0),
            "neg_adv_frac": valid_mean(advantages < 0),
            "empty": (n_valid == 0).to(dtype),
        }
        if selection.cov is not None and selection.reference is not None:  # a random control: overlap with c_t's pick
            metrics["selected_and_ref"] = valid_mean(selection.cov & selection.reference)
            metrics["selected_or_ref"] = valid_mean(selection.cov | selection.reference)
        if entropy is not None:
            metrics["entropy"] = valid_mean(entropy.detach())
        if selection.high_entropy is not None:
            metrics["high_entropy_frac"] = valid_mean(selection.high_entropy)
    return metrics


__all__ = [
    "AGGREGATIONS",
    "SCOPES",
    "LossConfig",
    "PolicyLossMode",
    "Selection",
    "SelectionInputs",
    "aggregate_loss",
    "available_modes",
    "clip_cov_loss",
    "compute_global_selection",
    "dual_clip",
    "get_policy_loss",
    "kl_cov_loss",
    "kl_cov_penalty",
    "policy_loss",
    "ppo_clip_terms",
    "ppo_clipped",
    "register",
    "vanilla_loss",
]
