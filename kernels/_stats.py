"""Streaming vocabulary statistics shared by the Triton kernels and the PyTorch twin (docs/design.md §3).

A partial covers some vocabulary columns of each row and holds, relative to its own running max m,

    s = Σ e^{z−m},  u = Σ e^{z−m}(z−m),  s2 = Σ e^{2(z−m)},  u2 = Σ e^{2(z−m)}(z−m),  zy = z of the label

(zy = −inf when the label is not among its columns). Partials over disjoint columns combine exactly;
``finalize`` turns the combined sums into log Z, log p(y), entropy, the vocabulary covariance κ and Σπ².
"""

from __future__ import annotations

import math

import torch

STAT_NAMES = ("m", "s", "u", "s2", "u2", "zy")


def combine_partials(partials: torch.Tensor) -> torch.Tensor:
    """Combine stacked partials over disjoint vocabulary columns.

    partials: [6, S, N] fp32 (rows of STAT_NAMES, S partials per token). Returns [6, N] fp32.
    A partial that saw no column has m = −inf and zero sums; it contributes nothing.
    """
    m, s, u, s2, u2, zy = partials.unbind(0)
    m_max = m.amax(0)
    m_ref = torch.where(torch.isfinite(m_max), m_max, torch.zeros_like(m_max))
    scale = torch.exp(m - m_ref)  # 0 for an empty partial
    shift = torch.where(torch.isfinite(m), m - m_ref, torch.zeros_like(m))  # avoids 0·(−inf)
    scale2 = scale * scale
    return torch.stack(
        (
            m_max,
            (scale * s).sum(0),
            (scale * (u + shift * s)).sum(0),
            (scale2 * s2).sum(0),
            (scale2 * (u2 + shift * s2)).sum(0),
            zy.amax(0),
        )
    )


def finalize(stats: torch.Tensor, valid: torch.Tensor, vocab_size: int, want_cov: bool, want_sum_p2: bool = False):
    """Turn combined stats [6, N] into (logsumexp, logprob, entropy, vocab_cov or None, sum_p2 or None), each [N]
    fp32.

    valid: [N] bool, False for ignore_index rows, which get logprob = entropy = κ = Σπ² = 0.
    Rounding is clamped so that logprob ≤ 0, 0 ≤ entropy ≤ log V and 1/V ≤ Σπ² ≤ 1 hold for finite inputs.
    Σπ² = s2/s² needs only s2 (κ needs u2 too).
    """
    m, s, u, s2, u2, zy = stats.unbind(0)
    log_s = torch.log(s)
    logsumexp = m + log_s
    zero = torch.zeros_like(logsumexp)
    logprob = torch.where(valid, (zy - logsumexp).clamp(max=0.0), zero)
    entropy = torch.where(valid, (log_s - u / s).clamp(min=0.0, max=math.log(vocab_size)), zero)
    vocab_cov = sum_p2 = None
    if want_cov or want_sum_p2:
        inv_s2 = 1.0 / (s * s)
        p2 = s2 * inv_s2
        if want_sum_p2:
            sum_p2 = torch.where(valid, p2.clamp(min=1.0 / vocab_size, max=1.0), zero)
        if want_cov:
            sum_p2_logp = (u2 - s2 * log_s) * inv_s2
            p_y = torch.exp(logprob)
            kappa = p_y * (logprob + entropy) - (sum_p2_logp + entropy * p2)
            vocab_cov = torch.where(valid, kappa, zero)
    return logsumexp, logprob, entropy, vocab_cov, sum_p2


def dz_from_upstream(z, logsumexp, entropy, labels_local, g, e, with_entropy: bool = True):
    """Gradient w.r.t. the tempered logits z of a tile, computed in place of z: [n, v] fp32.

    dz_v = g·(1[v=y] − p_v) − e·p_v·(log p_v + H); labels_local [n] int64 is the label's column
    inside the tile (out of [0, v) when it is elsewhere); g, e [n] fp32 (zero for ignored rows; a
    caller may pre-scale both by 1/T). ``with_entropy=False`` (e is zero everywhere: only log-probs
    need a gradient) drops the entropy term's passes: dz = −g·p + g·1[v=y].
    """
    logp = z.sub_(logsumexp[:, None])
    if with_entropy:
        p = torch.exp(logp)
        dz = logp.add_(entropy[:, None]).mul_(e[:, None]).add_(g[:, None]).mul_(p).neg_()
        del p
    else:
        dz = logp.exp_().mul_(g.neg()[:, None])
    hit = (labels_local >= 0) & (labels_local < z.shape[1])
    column = labels_local.clamp(0, z.shape[1] - 1)[:, None]
    return dz.scatter_add_(1, column, torch.where(hit, g, torch.zeros_like(g))[:, None])
