"""``policy_loss``: one call from per-token log-probs to the aggregated loss and its metrics (the mode's
token loss, the selection, sequence-level modes, weights, aggregation)."""

from __future__ import annotations

import math

import torch

from fastcov.covariance import IMPLS, token_covariance
from fastcov.losses.aggregate import _check_agg, aggregate_loss, segment_index
from fastcov.losses.config import SCOPES, LossConfig, Selection
from fastcov.losses.modes import get_policy_loss, ppo_clip_terms
from fastcov.losses.token_selection import _check_loss_inputs, _coerce_selection, _sanitize, _select_tokens


def _check_finite_advantages(advantages: torch.Tensor, valid: torch.Tensor) -> None:
    if not bool(torch.isfinite(torch.where(valid, advantages, torch.zeros_like(advantages))).all()):
        raise ValueError("advantages must be finite on valid tokens (found NaN or inf)")


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
