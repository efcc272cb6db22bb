"""Rollout correction: importance weights, rejection and mismatch metrics for a rollout engine that is not the policy.

A rollout engine (vLLM, another precision, a stale copy) samples from π_rollout, the trainer scores the same
tokens with π_old (its own forward before the update). Per token, with ``log_ratio = log π_old − log π_rollout``:

    token level     w_t = exp(clamp(log_ratio_t, ±20))
    sequence level  w_t = exp(clamp(Σ_{valid s} log_ratio_s, ±20)) for every valid t of the sequence
    truncate        w ← clamp(w, clip_min, clip_max)         (TIS; verl's ``rollout_is_threshold: 2.0``)
    mask            w ← w · [clip_min ≤ w ≤ clip_max]        (IcePop / TRL's *_mask; verl's "lower_upper")

Rejection (verl's ``rollout_rs``): per criterion ``<level>_<estimator>`` with level token | seq_sum | seq_mean |
seq_max and estimator k1 = −log_ratio, k2 = ½·log_ratio², k3 = e^{log_ratio} − 1 − log_ratio, a token (or every
token of a sequence) is dropped when its statistic leaves the bound; several criteria chain (all must pass).
The off-policy sequence mask (DeepSeek-V3.2, TRL's ``off_policy_mask_threshold``) drops the tokens with A < 0 of
the sequences whose mean k1 exceeds δ. ``mismatch_metrics`` are verl's off-policy diagnostics (KL, k3 KL,
perplexities, χ²), under verl's names (without its ``rollout_corr/`` prefix).

Every function takes [B, T] tensors with one sequence per row (padding anywhere, given by ``mask``), computes
no gradient and returns detached 0-dim tensors as metrics (no host sync except the input checks). docs/design.md §4.
"""

from __future__ import annotations

import math

import torch

LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
ESTIMATORS = ("k1", "k2", "k3")
# verl's list: seq_max of k1 is not a criterion (a signed maximum bounds one side only)
REJECTION_CRITERIA = tuple(
    f"{level}_{k}" for level in REJECTION_LEVELS for k in ESTIMATORS if (level, k) != ("seq_max", "k1")
)
# bound on every exponent, as verl's SAFETY_BOUND: e^20 ≈ 4.9e8
EXP_BOUND = 20.0


# ---------------------------------------------------------------- checks and masked reductions


def _check_pair(name: str, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The bool mask of valid tokens; one-line errors naming the argument."""
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {getattr(values, 'dtype', type(values).__name__)}")
    if values.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(values.shape)}")
    if not isinstance(mask, torch.Tensor) or mask.shape != values.shape:
        got = tuple(getattr(mask, "shape", ()))
        raise ValueError(f"mask must have {name}'s shape {tuple(values.shape)}, got {got}")
    if mask.is_floating_point() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must be bool or 0/1")
    valid = mask.bool()
    if not bool(valid.any()):
        raise ValueError("mask has no valid token (an empty batch has nothing to correct)")
    if not bool(torch.isfinite(torch.where(valid, values.detach(), 0.0)).all()):
        raise ValueError(f"{name} must be finite on valid tokens")
    return valid


def _check_bound(name: str, value, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a ratio > 0, got {value}")
    return float(value)


def _zero(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.zeros_like(values))


def _mean(values: torch.Tensor, valid: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid entries (of each row with ``dim=-1``); 0 where there are none."""
    total = _zero(values, valid).sum() if dim is None else _zero(values, valid).sum(dim)
    count = valid.sum() if dim is None else valid.sum(dim)
    return total / count.clamp(min=1).to(values.dtype)


def _max(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, -math.inf).amax()


def _min(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, math.inf).amin()


def _std_unbiased(values: torch.Tensor) -> torch.Tensor:
    return values.std() if values.numel() > 1 else torch.zeros((), dtype=values.dtype, device=values.device)


def sequence_log_ratio(log_ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Σ over each row's valid tokens of ``log_ratio``: [B] (the log of the sequence's likelihood ratio)."""
    return _zero(log_ratio, valid).sum(-1)


def bounded_exp(log_value: torch.Tensor) -> torch.Tensor:
    """exp(clamp(x, −20, 20)): the one place an importance ratio is exponentiated."""
    return torch.exp(log_value.clamp(-EXP_BOUND, EXP_BOUND))


# ---------------------------------------------------------------- importance weights


def rollout_correction(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    clip_max: float | None = 2.0,
    clip_min: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights π_old / π_rollout of the rollout's tokens, truncated or masked.

    Args:
        log_ratio: floating [B, T], log π_old − log π_rollout per token (one sequence per row); finite on
            valid tokens, anything on padding.
        mask: bool or 0/1 [B, T], valid (response) tokens; at least one.
        level: "token" (a weight per token) or "sequence" (exp of the row's summed log-ratio, on each of its
            valid tokens).
        mode: "truncate" (clamp the weights to [clip_min, clip_max]) or "mask" (weights outside
            [clip_min, clip_max] become 0; no bound on the side given as None).
        clip_max: the upper ratio bound, > 0 (None: no upper bound, TRL's ``vllm_importance_sampling_clip_max=None``;
            a bound past the range of log_ratio's dtype bounds nothing either).
        clip_min: the lower ratio bound, > 0 and ≤ clip_max (None: no lower bound).

    Returns:
        (weights, metrics). weights: [B, T] of log_ratio's dtype, detached, 0 on padding. metrics: verl's
        ``rollout_is_*`` statistics (mean, max, min, ratio_fraction_high/low, std, eff_sample_size,
        seq_mean/std/max/min/max_deviation/fraction_high/fraction_low and, in mask mode, oob_ratio),
        detached 0-dim tensors; the "low" bound of the fractions is clip_min, or 1/clip_max without it (none without
        either), the "high" bound clip_max (none without it).
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    upper = _check_bound("clip_max", clip_max, optional=True)
    lower = _check_bound("clip_min", clip_min, optional=True)
    if lower is not None and upper is not None and lower > upper:
        raise ValueError(f"clip_min must be ≤ clip_max, got {lower} > {upper}")
    valid = _check_pair("log_ratio", log_ratio, mask)
    with torch.no_grad():
        log_ratio = _zero(log_ratio.detach(), valid)
        if level == "token":
            raw = bounded_exp(log_ratio)
            log_for_metrics = log_ratio
        else:
            seq = sequence_log_ratio(log_ratio, valid)[:, None]
            raw = bounded_exp(seq).expand_as(log_ratio)
            log_for_metrics = seq
        raw = _zero(raw, valid)
        # the comparisons below take Python floats of any size; only a clamp's bound must fit the dtype, and one
        # past its range bounds nothing (the weights are at most e^20)
        finite_max = torch.finfo(raw.dtype).max
        high = math.inf if upper is None else upper
        low = -math.inf if lower is None else lower
        if mode == "truncate":
            cap = None if high > finite_max else high
            weights = raw if lower is None and cap is None else _zero(raw.clamp(min=lower, max=cap), valid)
        else:
            weights = _zero(raw, (raw >= low) & (raw <= high))
        metrics = _is_metrics(weights, raw, log_for_metrics, valid, level, upper, lower)
        if mode == "mask":
            metrics["rollout_is_oob_ratio"] = _mean(((raw < low) | (raw > high)).to(raw.dtype), valid)
    return weights, metrics


def _is_metrics(weights, raw, log_for_metrics, valid, level, upper, lower) -> dict[str, torch.Tensor]:
    dtype = weights.dtype
    high = math.inf if upper is None else upper  # no upper bound: nothing is high, and (without clip_min) nothing low
    low = lower if lower is not None else 0.0 if upper is None else 1.0 / upper
    m: dict[str, torch.Tensor] = {"rollout_is_mean": _mean(weights, valid)}
    if level == "sequence":  # one log-ratio per row (rows without valid tokens count, with 0)
        m["rollout_is_max"] = torch.exp(log_for_metrics.max().clamp(max=EXP_BOUND))
        m["rollout_is_min"] = torch.exp(log_for_metrics.min())
        m["rollout_is_ratio_fraction_high"] = (log_for_metrics > math.log(high)).to(dtype).mean()
        m["rollout_is_ratio_fraction_low"] = (log_for_metrics < (math.log(low) if low > 0 else -math.inf)).to(
            dtype).mean()
    else:
        m["rollout_is_ratio_fraction_high"] = _mean((raw > high).to(dtype), valid)
        m["rollout_is_ratio_fraction_low"] = _mean((raw < low).to(dtype), valid)
        m["rollout_is_max"] = _max(weights, valid)
        m["rollout_is_min"] = _min(weights, valid)
    bounded = weights if high > torch.finfo(dtype).max else weights.clamp(0.0, high)
    mean_bounded = _mean(bounded, valid)
    if int(valid.sum()) > 1:
        m["rollout_is_std"] = (_mean(bounded.square(), valid) - mean_bounded.square()).clamp(min=0.0).sqrt()
    else:
        m["rollout_is_std"] = torch.zeros((), dtype=dtype, device=weights.device)
    m["rollout_is_eff_sample_size"] = 1.0 / _mean((bounded / (mean_bounded + 1e-8)).square(), valid)
    seq_weights = _mean(weights, valid, dim=-1)
    m["rollout_is_seq_mean"] = seq_weights.mean()
    m["rollout_is_seq_std"] = _std_unbiased(seq_weights)
    m["rollout_is_seq_max"] = seq_weights.max()
    m["rollout_is_seq_min"] = seq_weights.min()
    m["rollout_is_seq_max_deviation"] = (seq_weights - 1.0).abs().max()
    raw_seq = _mean(raw, valid, dim=-1)
    m["rollout_is_seq_fraction_high"] = (raw_seq > high).to(dtype).mean()
    m["rollout_is_seq_fraction_low"] = (raw_seq < low).to(dtype).mean()
    return m


# ---------------------------------------------------------------- rejection


def divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimator of KL(π_rollout ‖ π_old) from ``log_ratio`` (bounded to ±20): k1 = −x, k2 = x²/2,
    k3 = eˣ − 1 − x."""
    x = log_ratio.clamp(-EXP_BOUND, EXP_BOUND)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return torch.exp(x) - 1.0 - x
    raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")


def _parse_criteria(criteria) -> list[str]:
    names = [c.strip() for c in criteria.split(",")] if isinstance(criteria, str) else list(criteria)
    names = [c for c in names if c]
    if not names:
        raise ValueError("criteria must name at least one of " + ", ".join(REJECTION_CRITERIA))
    for c in names:
        if c not in REJECTION_CRITERIA:
            raise ValueError(f"criteria: unknown {c!r}, expected one of {REJECTION_CRITERIA}")
    return list(dict.fromkeys(names))


def _parse_thresholds(thresholds, criteria: list[str]) -> list[tuple[float | None, float]]:
    """Per criterion (lower, upper) bounds of its statistic: for k1 the log of the ratio bounds ("lo_hi" or a
    single hi meaning 1/hi_hi), for k2/k3 (None, hi)."""
    if isinstance(thresholds, bool) or thresholds is None:
        raise TypeError("thresholds must be a number, a string or a list of them")
    if isinstance(thresholds, (int, float)):
        specs = [str(thresholds)]
    elif isinstance(thresholds, str):
        specs = [s.strip() for s in thresholds.split(",") if s.strip()]
    else:
        specs = [str(s) for s in thresholds]
    if len(specs) == 1:
        specs = specs * len(criteria)
    if len(specs) != len(criteria):
        raise ValueError(
            f"thresholds: give one for all criteria or one per criterion ({len(criteria)}), got {len(specs)}"
        )
    bounds: list[tuple[float | None, float]] = []
    for c, spec in zip(criteria, specs, strict=True):
        parts = spec.split("_")
        try:
            numbers = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"thresholds: {spec!r} for {c} is not a number (or lo_hi for k1)") from None
        if len(numbers) > (2 if c.endswith("k1") else 1) or not all(math.isfinite(v) and v > 0 for v in numbers):
            form = "a ratio > 0 or lo_hi" if c.endswith("k1") else "one bound > 0"
            raise ValueError(f"thresholds: {spec!r} for {c} must be {form}")
        if c.endswith("k1"):
            lo, hi = (1.0 / numbers[0], numbers[0]) if len(numbers) == 1 else (numbers[0], numbers[1])
            if lo > hi:
                raise ValueError(f"thresholds: {spec!r} for {c} has lo > hi")
            bounds.append((math.log(lo), math.log(hi)))
        else:
            bounds.append((None, numbers[0]))
    return bounds


def rollout_rejection(
    log_ratio: torch.Tensor, mask: torch.Tensor, criteria="token_k1", thresholds=2.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Drop tokens or sequences whose divergence from the rollout leaves a bound (verl's ``rollout_rs``).

    Args:
        log_ratio: floating [B, T], log π_old − log π_rollout; mask: bool or 0/1 [B, T], at least one valid.
        criteria: "a,b" or a list of names in ``REJECTION_CRITERIA`` (``<token|seq_sum|seq_mean|seq_max>_<k>``);
            a token is kept when every criterion keeps it.
        thresholds: one for all criteria or one per criterion (a comma string or a list): for k1 a ratio
            bound hi (keeps −log_ratio in [−log hi, log hi]) or "lo_hi"; for k2/k3 the upper bound.

    Returns:
        (keep, metrics). keep: bool [B, T], False on padding and on rejected tokens. metrics: verl's
        ``rollout_rs_<criterion>_*`` statistics of each statistic and ``rollout_rs_masked_fraction`` /
        ``rollout_rs_seq_masked_fraction`` (the latter over all rows).
    """
    names = _parse_criteria(criteria)
    bounds = _parse_thresholds(thresholds, names)
    valid = _check_pair("log_ratio", log_ratio, mask)
    with torch.no_grad():
        log_ratio = _zero(log_ratio.detach(), valid)
        dtype = log_ratio.dtype
        has_tokens = valid.any(-1)
        keep = valid.clone()
        metrics: dict[str, torch.Tensor] = {}
        for name, (lo, hi) in zip(names, bounds, strict=True):
            level, estimator = name.rsplit("_", 1)
            stat = divergence(log_ratio, estimator)
            seq_stat = None
            if level == "seq_sum":
                seq_stat = _zero(stat, valid).sum(-1)
            elif level == "seq_mean":
                seq_stat = _mean(stat, valid, dim=-1)
            elif level == "seq_max":
                seq_stat = torch.where(has_tokens, torch.where(valid, stat, -math.inf).amax(-1), 0.0)
            if seq_stat is not None:
                stat = seq_stat[:, None].expand_as(log_ratio)
            passes = (stat <= hi) if lo is None else (stat >= lo) & (stat <= hi)
            keep &= passes
            metrics.update(_rs_metrics(name, stat, seq_stat, valid, has_tokens, lo, hi))
            rejected = valid & ~passes
            metrics[f"rollout_rs_{name}_masked_fraction"] = _mean(rejected.to(dtype), valid)
            metrics[f"rollout_rs_{name}_seq_masked_fraction"] = _fraction(rejected.any(-1), has_tokens, dtype)
        metrics["rollout_rs_masked_fraction"] = _mean((~keep).to(dtype), valid)
        metrics["rollout_rs_seq_masked_fraction"] = (valid & ~keep).any(-1).to(dtype).mean()
    return keep, metrics


def _fraction(flags: torch.Tensor, rows: torch.Tensor, dtype) -> torch.Tensor:
    return (flags & rows).sum().to(dtype) / rows.sum().clamp(min=1).to(dtype)


def _rs_metrics(name, stat, seq_stat, valid, has_tokens, lo, hi) -> dict[str, torch.Tensor]:
    """verl's per-criterion statistics (``compute_rs_metrics``): k1's bounds in log space, k2/k3's lower 0."""
    p = f"rollout_rs_{name}"
    dtype = stat.dtype
    low = 0.0 if lo is None else lo
    per_seq = _mean(stat, valid, dim=-1) if seq_stat is None else seq_stat
    seqs = per_seq[has_tokens]
    m = {f"{p}_mean": _mean(stat, valid)}
    none = torch.zeros((), dtype=dtype, device=stat.device)
    if seq_stat is not None:
        m[f"{p}_max"], m[f"{p}_min"] = seqs.max(), seqs.min()
        m[f"{p}_fraction_high"] = (seqs > hi).to(dtype).mean()
        m[f"{p}_fraction_low"] = (seqs < low).to(dtype).mean() if lo is not None else none
    else:
        m[f"{p}_max"], m[f"{p}_min"] = _max(stat, valid), _min(stat, valid)
        m[f"{p}_fraction_high"] = _mean((stat > hi).to(dtype), valid)
        m[f"{p}_fraction_low"] = _mean((stat < low).to(dtype), valid) if lo is not None else none
    if int(valid.sum()) > 1:
        bounded = stat.clamp(min=low, max=hi)
        m[f"{p}_std"] = (_mean(bounded.square(), valid) - _mean(bounded, valid).square()).clamp(min=0.0).sqrt()
    else:
        m[f"{p}_std"] = torch.zeros((), dtype=dtype, device=stat.device)
    m[f"{p}_seq_mean"], m[f"{p}_seq_std"] = seqs.mean(), _std_unbiased(seqs)
    m[f"{p}_seq_max"], m[f"{p}_seq_min"] = seqs.max(), seqs.min()
    m[f"{p}_seq_max_deviation"] = seqs.abs().max()
    m[f"{p}_seq_fraction_high"] = (seqs > hi).to(dtype).mean()
    if lo is not None:
        m[f"{p}_seq_fraction_low"] = (seqs < low).to(dtype).mean()
    return m


# ---------------------------------------------------------------- off-policy sequence mask


def off_policy_sequence_mask(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``).

    A token is dropped when its advantage is < 0 and its sequence's mean k1 = mean(−log_ratio) over valid
    tokens exceeds ``threshold`` (δ ≥ 0): negative samples the policy has drifted away from.

    Args:
        log_ratio: floating [B, T], log π − log π_rollout; advantages: floating [B, T] or [B] (one per
            sequence); mask: bool or 0/1 [B, T]; threshold: δ ≥ 0.
    Returns:
        (keep bool [B, T], {"off_policy_masked_fraction": share of valid tokens dropped}).
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold must be a number ≥ 0, got {threshold!r}")
    valid = _check_pair("log_ratio", log_ratio, mask)
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise TypeError("advantages must be a floating tensor")
    if advantages.shape == log_ratio.shape[:1]:
        advantages = advantages[:, None]
    elif advantages.shape != log_ratio.shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(log_ratio.shape)}, got {tuple(advantages.shape)}")
    with torch.no_grad():
        seq_kl = _mean(-log_ratio.detach(), valid, dim=-1)[:, None]
        keep = valid & ((advantages.detach() >= 0) | (seq_kl <= threshold))
        dropped = _mean((valid & ~keep).to(log_ratio.dtype), valid)
    return keep, {"off_policy_masked_fraction": dropped}


# ---------------------------------------------------------------- mismatch metrics


def mismatch_metrics(
    old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """verl's off-policy diagnostics of the trainer's log-probs against the rollout's, verl's names.

    Args: old_logprob, rollout_logprob: floating [B, T] (one sequence per row); mask: bool or 0/1 [B, T].
    Returns detached 0-dim tensors: kl (mean log π_rollout − log π_old), k3_kl, training_ppl /
    rollout_ppl (batch mean of each row's exp(−mean log-prob)), training_log_ppl / rollout_log_ppl,
    log_ppl_diff (+ abs, max, min), ppl_ratio, chi2_token (E[ρ²] − 1) and chi2_seq (E[(Πρ)²] − 1).
    Means over rows include rows without valid tokens (as 0 log-prob), as verl's do.
    """
    valid = _check_pair("old_logprob", old_logprob, mask)
    _check_pair("rollout_logprob", rollout_logprob, mask)
    if old_logprob.dtype != rollout_logprob.dtype:
        raise TypeError(
            f"rollout_logprob must have old_logprob's dtype {old_logprob.dtype}, got {rollout_logprob.dtype}"
        )
    with torch.no_grad():
        old = _zero(old_logprob.detach(), valid)
        rollout = _zero(rollout_logprob.detach(), valid)
        log_ratio = old - rollout
        train_mean, rollout_mean = _mean(old, valid, dim=-1), _mean(rollout, valid, dim=-1)
        log_ppl_diff = rollout_mean - train_mean
        return {
            "training_ppl": torch.exp(-train_mean).mean(),
            "training_log_ppl": (-train_mean).mean(),
            "kl": _mean(-log_ratio, valid),
            "k3_kl": _mean(torch.exp(log_ratio) - log_ratio - 1.0, valid),
            "rollout_ppl": torch.exp(-rollout_mean).mean(),
            "rollout_log_ppl": (-rollout_mean).mean(),
            "log_ppl_diff": log_ppl_diff.mean(),
            "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
            "log_ppl_diff_max": log_ppl_diff.max(),
            "log_ppl_diff_min": log_ppl_diff.min(),
            "ppl_ratio": torch.exp(log_ppl_diff).mean(),
            "chi2_token": _mean(bounded_exp(log_ratio).square(), valid) - 1.0,
            "chi2_seq": torch.exp(2.0 * sequence_log_ratio(log_ratio, valid).clamp(-EXP_BOUND, EXP_BOUND)).mean() - 1.0,
        }


__all__ = [
    "ESTIMATORS",
    "EXP_BOUND",
    "IS_MODES",
    "LEVELS",
    "REJECTION_CRITERIA",
    "bounded_exp",
    "divergence",
    "mismatch_metrics",
    "off_policy_sequence_mask",
    "rollout_correction",
    "rollout_rejection",
    "sequence_log_ratio",
]
