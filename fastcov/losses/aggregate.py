"""Aggregation of a [B, T] loss to a scalar (``loss_agg``: token-mean and the three sequence means), over
the call or the mini-batch totals, and the sequence index of packed rows."""

from __future__ import annotations

import torch

from fastcov.losses.config import AGGREGATIONS

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
