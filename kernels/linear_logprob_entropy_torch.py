"""Plain-PyTorch twin of the fused vocabulary kernel: same statistics, same results, any device.

The logits are computed chunk by chunk (chunk_n tokens × chunk_v vocabulary columns, fp32) and folded
into the streaming statistics of ``_stats``; the backward recomputes each chunk. Peak extra memory is
O(chunk_n·chunk_v + N) beyond the inputs and the gradient buffers (plus an fp32 [N, D] accumulator for
dh and a [chunk_v, D] one for dW when the inputs are fp16/bf16).
"""

from __future__ import annotations

import torch

from fastcov.kernels._stats import combine_partials, dz_from_upstream

# About 1M fp32 elements per logits chunk: 4 MB, a handful of which are alive at once.
CHUNK_ELEMENTS = 1 << 20
MAX_CHUNK_V = 4096


def chunk_sizes(n: int, v: int, chunk_elements: int = CHUNK_ELEMENTS) -> tuple[int, int]:
    chunk_v = max(1, min(v, MAX_CHUNK_V))
    chunk_n = max(1, min(n, chunk_elements // chunk_v))
    return chunk_n, chunk_v


def _tempered_logits(h, w, b, inv_temp):
    """fp32 logits z = (h W^T + b)/T of one chunk: h [n, D], w [v, D] -> [n, v]."""
    z = h.float() @ w.float().T
    if b is not None:
        z.add_(b.float())
    return z.mul_(inv_temp)


def stats_forward(hidden, weight, bias, labels, temperature, topk, chunk_elements=CHUNK_ELEMENTS):
    """Streaming statistics over the vocabulary.

    hidden [N, D], weight [V, D], bias [V] or None, labels [N] int64. Returns the combined stats
    [6, N] fp32 (see ``_stats.STAT_NAMES``) and, when topk > 0, (values [N, k] fp32 logits z,
    indices [N, k] int64), else (None, None).
    """
    n, v = hidden.shape[0], weight.shape[0]
    chunk_n, chunk_v = chunk_sizes(n, v, chunk_elements)
    inv_temp = 1.0 / temperature
    stats = torch.empty(6, n, dtype=torch.float32, device=hidden.device)
    top_values = top_indices = None
    if topk:
        top_values = torch.empty(n, topk, dtype=torch.float32, device=hidden.device)
        top_indices = torch.empty(n, topk, dtype=torch.int64, device=hidden.device)
    for r0 in range(0, n, chunk_n):
        rows = slice(r0, min(n, r0 + chunk_n))
        h, y = hidden[rows], labels[rows]
        running = None
        cand_v, cand_i = [], []
        for c0 in range(0, v, chunk_v):
            c1 = min(v, c0 + chunk_v)
            z = _tempered_logits(h, weight[c0:c1], None if bias is None else bias[c0:c1], inv_temp)
            m = z.amax(1)
            local = y - c0
            hit = (local >= 0) & (local < c1 - c0)
            zy = torch.gather(z, 1, local.clamp(0, c1 - c0 - 1)[:, None])[:, 0]
            zy = torch.where(hit, zy, torch.full_like(zy, float("-inf")))
            if topk:
                kk = min(topk, c1 - c0)
                tv, ti = torch.topk(z, kk, dim=1)
                cand_v.append(tv)
                cand_i.append(ti + c0)
            zc = z.sub_(m[:, None])  # in place: a handful of chunk-sized buffers alive at most
            e = torch.exp(zc)
            s_, u_ = e.sum(1), torch.mul(e, zc).sum(1)
            e2 = e.mul_(e)
            part = torch.stack((m, s_, u_, e2.sum(1), torch.mul(e2, zc).sum(1), zy))
            del zc, z, e, e2
            running = part if running is None else combine_partials(torch.stack((running, part), 1))
            # keep the top-k candidate set small: fold as soon as it exceeds a few k
            if topk and sum(t.shape[1] for t in cand_v) > 4 * topk:
                tv, pos = torch.topk(torch.cat(cand_v, 1), topk, dim=1)
                cand_v, cand_i = [tv], [torch.gather(torch.cat(cand_i, 1), 1, pos)]
        stats[:, rows] = running
        if topk:
            tv, pos = torch.topk(torch.cat(cand_v, 1), topk, dim=1)
            top_values[rows] = tv
            top_indices[rows] = torch.gather(torch.cat(cand_i, 1), 1, pos)
    return stats, (top_values, top_indices)


def grad_backward(
    hidden, weight, bias, labels, temperature, logsumexp, entropy, g, e,
    chunk_elements=CHUNK_ELEMENTS,
):
    """Gradients of Σ g·logprob + e·entropy w.r.t. hidden, weight and bias (None when bias is None).

    g, e: [N] fp32, zero on ignored rows. logsumexp, entropy: [N] fp32 from the forward.
    Recomputes every chunk; dh accumulates in fp32 over vocabulary chunks, dW in fp32 over token chunks.
    """
    n, d = hidden.shape
    v = weight.shape[0]
    chunk_n, chunk_v = chunk_sizes(n, v, chunk_elements)
    inv_temp = 1.0 / temperature
    fp32 = hidden.dtype == torch.float32
    dh = torch.zeros(n, d, dtype=torch.float32, device=hidden.device)
    dw = torch.empty_like(weight)
    db = None if bias is None else torch.empty_like(bias)
    for c0 in range(0, v, chunk_v):
        c1 = min(v, c0 + chunk_v)
        w = weight[c0:c1]
        w32 = w.float()
        dw_acc = torch.zeros(c1 - c0, d, dtype=torch.float32, device=hidden.device)
        db_acc = None if bias is None else torch.zeros(c1 - c0, dtype=torch.float32, device=hidden.device)
        for r0 in range(0, n, chunk_n):
            rows = slice(r0, min(n, r0 + chunk_n))
            h32 = hidden[rows].float()
            z = _tempered_logits(h32, w32, None if bias is None else bias[c0:c1], inv_temp)
            dz = dz_from_upstream(z, logsumexp[rows], entropy[rows], labels[rows] - c0, g[rows], e[rows])
            dz.mul_(inv_temp)
            dh[rows].addmm_(dz, w32)
            dw_acc.addmm_(dz.T, h32)
            if db_acc is not None:
                db_acc += dz.sum(0)
            del dz
        dw[c0:c1] = dw_acc if fp32 else dw_acc.to(weight.dtype)
        if db is not None:
            db[c0:c1] = db_acc.to(bias.dtype)
    return dh.to(hidden.dtype), dw, db
