"""Fused vocabulary kernel in Triton: log-prob of the label, entropy, vocabulary covariance and top-k
straight from hidden states and the LM head, forward and backward, never materializing N×V logits.

Forward: program (row block, vocabulary split) streams its vocabulary tiles, computing each logits tile
with ``tl.dot`` over D chunks into fp32 and folding it into the accumulators of DESIGN §3 (running max
from −inf; columns past V are −inf). Splits write partials that ``_stats.combine_partials`` merges
(O(N·splits)), so a few thousand tokens still fill the GPU.

Backward: program (row block, vocabulary tile) recomputes the tile, forms dz from the upstream
gradients of logprob and entropy, and adds dz·W into dh and dzᵀ·h into dW with fp32 atomics; both are
cast to the input dtype at the end. Nothing of size N×V is ever allocated.

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (then with small fixed tiles).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastcov.kernels._stats import combine_partials


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, D, stride_hn, stride_hd,
                 stride_wv, stride_wd, inv_temp,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 tempered logits of a [BLOCK_N, BLOCK_V] tile; masked rows/columns hold finite garbage."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dk = d0 + offs_d
        dmask = dk < D
        h = tl.load(h_ptr + rows[:, None] * stride_hn + dk[None, :] * stride_hd,
                    mask=row_mask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wv + dk[None, :] * stride_wd,
                    mask=col_mask[:, None] & dmask[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temp


@triton.jit
def _forward_kernel(h_ptr, w_ptr, b_ptr, y_ptr, part_ptr, topv_ptr, topi_ptr,
                    N, V, D, SPLITS, stride_hn, stride_hd, stride_wv, stride_wd, inv_temp,
                    HAS_BIAS: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                    PRECISION: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    labels = tl.load(y_ptr + rows, mask=row_mask, other=-1)

    neg_inf = float("-inf")
    m = tl.full((BLOCK_N,), neg_inf, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    u = tl.zeros((BLOCK_N,), tl.float32)
    s2 = tl.zeros((BLOCK_N,), tl.float32)
    u2 = tl.zeros((BLOCK_N,), tl.float32)
    zy = tl.full((BLOCK_N,), neg_inf, tl.float32)
    if TOPK > 0:
        slot = tl.arange(0, TOPK_PAD)
        # padding slots hold +inf so they are never the smallest kept value
        top_v = tl.where(slot[None, :] < TOPK, neg_inf, float("inf")) + tl.zeros((BLOCK_N, TOPK_PAD), tl.float32)
        top_i = tl.zeros((BLOCK_N, TOPK_PAD), tl.int32)

    n_tiles = tl.cdiv(V, BLOCK_V)
    tiles_per_split = tl.cdiv(n_tiles, SPLITS)
    for t in range(0, tiles_per_split):
        v0 = (pid_s * tiles_per_split + t) * BLOCK_V
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, D, stride_hn, stride_hd,
                         stride_wv, stride_wd, inv_temp, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION)
        z = tl.where(col_mask[None, :], z, neg_inf)

        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_ref = tl.where(m_new == neg_inf, 0.0, m_new)  # a split past V sees no column at all
        scale = tl.exp(m - m_ref)
        shift = tl.where(m == neg_inf, 0.0, m - m_ref)
        zc = tl.where(col_mask[None, :], z - m_ref[:, None], 0.0)
        e = tl.where(col_mask[None, :], tl.exp(zc), 0.0)
        e2 = e * e
        u = scale * (u + shift * s) + tl.sum(e * zc, axis=1)
        s = scale * s + tl.sum(e, axis=1)
        u2 = scale * scale * (u2 + shift * s2) + tl.sum(e2 * zc, axis=1)
        s2 = scale * scale * s2 + tl.sum(e2, axis=1)
        m = m_new
        hit = cols[None, :] == labels[:, None]
        zy = tl.maximum(zy, tl.max(tl.where(hit, z, neg_inf), axis=1))

        if TOPK > 0:
            # insert the tile's largest values one by one in place of the smallest kept value
            cand = z
            local = tl.arange(0, BLOCK_V)
            for _ in tl.static_range(TOPK):
                best = tl.max(cand, axis=1)
                best_at = tl.argmax(cand, axis=1)
                worst = tl.min(top_v, axis=1)
                worst_at = tl.argmin(top_v, axis=1)
                take = best > worst
                put = (slot[None, :] == worst_at[:, None]) & take[:, None]
                top_v = tl.where(put, best[:, None], top_v)
                top_i = tl.where(put, (v0 + best_at)[:, None], top_i)
                cand = tl.where(local[None, :] == best_at[:, None], neg_inf, cand)

    base = part_ptr + pid_s * N + rows
    stride_stat = SPLITS * N
    tl.store(base, m, mask=row_mask)
    tl.store(base + stride_stat, s, mask=row_mask)
    tl.store(base + 2 * stride_stat, u, mask=row_mask)
    tl.store(base + 3 * stride_stat, s2, mask=row_mask)
    tl.store(base + 4 * stride_stat, u2, mask=row_mask)
    tl.store(base + 5 * stride_stat, zy, mask=row_mask)
    if TOPK > 0:
        offs = (pid_s * N + rows)[:, None] * TOPK + slot[None, :]
        kmask = row_mask[:, None] & (slot[None, :] < TOPK)
        tl.store(topv_ptr + offs, top_v, mask=kmask)
        tl.store(topi_ptr + offs, top_i, mask=kmask)


@triton.jit
def _backward_kernel(h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, g_ptr, e_ptr,
                     dh_ptr, dw_ptr, db_ptr,
                     N, V, D, stride_hn, stride_hd, stride_wv, stride_wd, inv_temp,
                     HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = cols < V
    labels = tl.load(y_ptr + rows, mask=row_mask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_mask, other=0.0)
    e = tl.load(e_ptr + rows, mask=row_mask, other=0.0)

    z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, D, stride_hn, stride_hd,
                     stride_wv, stride_wd, inv_temp, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION)
    logp = z - lse[:, None]
    p = tl.exp(logp)
    dz = -(g[:, None] + e[:, None] * (logp + ent[:, None])) * p
    dz += tl.where(cols[None, :] == labels[:, None], g[:, None], 0.0)
    dz = tl.where(row_mask[:, None] & col_mask[None, :], dz * inv_temp, 0.0)

    if HAS_BIAS:
        tl.atomic_add(db_ptr + cols, tl.sum(dz, axis=0), mask=col_mask)
    dz_in = dz.to(h_ptr.dtype.element_ty)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dk = d0 + offs_d
        dmask = dk < D
        w = tl.load(w_ptr + cols[:, None] * stride_wv + dk[None, :] * stride_wd,
                    mask=col_mask[:, None] & dmask[None, :], other=0.0)
        h = tl.load(h_ptr + rows[:, None] * stride_hn + dk[None, :] * stride_hd,
                    mask=row_mask[:, None] & dmask[None, :], other=0.0)
        dh = tl.dot(dz_in, w, input_precision=PRECISION)
        tl.atomic_add(dh_ptr + rows[:, None] * D + dk[None, :], dh,
                      mask=row_mask[:, None] & dmask[None, :])
        dw = tl.dot(tl.trans(dz_in), h, input_precision=PRECISION)
        tl.atomic_add(dw_ptr + cols[:, None] * D + dk[None, :], dw,
                      mask=col_mask[:, None] & dmask[None, :])


# Hopper (H100/H200) search space; the key buckets by problem shape. Untuned until a GPU run lands.
def _hopper_configs(backward: bool):
    configs = []
    for bn, bv in ((64, 64), (64, 128), (128, 64), (128, 128), (128, 256)):
        for bd in (32, 64):
            for warps, stages in ((4, 3), (8, 3), (8, 4)):
                if backward and bn * bv > 128 * 128:
                    continue
                configs.append(triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_D": bd},
                                             num_warps=warps, num_stages=stages))
    return configs


_forward_tuned = triton.autotune(configs=_hopper_configs(False), key=["V", "D", "TOPK"])(_forward_kernel)
_backward_tuned = triton.autotune(
    configs=_hopper_configs(True), key=["V", "D"], reset_to_zero=["dh_ptr", "dw_ptr", "db_ptr"],
)(_backward_kernel)

# Small fixed tiles for the CPU interpreter (slow: every tile is numpy).
INTERPRETER_TILES = {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_D": 16}


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _default_splits(n: int, v: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    row_blocks = triton.cdiv(n, 64)
    return max(1, min(triton.cdiv(2 * sms, row_blocks), triton.cdiv(v, 512)))


def stats_forward(hidden, weight, bias, labels, temperature, topk, splits=None):
    """Same contract as the twin's ``stats_forward``: ([6, N] fp32 stats, (topk logits, topk indices))."""
    n, d = hidden.shape
    v = weight.shape[0]
    splits = splits or _default_splits(n, v, hidden.device)
    # NaN poison: an element the kernel fails to write shows up in every output
    partials = torch.full((6, splits, n), float("nan"), dtype=torch.float32, device=hidden.device)
    topk_pad = triton.next_power_of_2(topk) if topk else 1
    topv = torch.full((splits, n, max(topk, 1)), float("nan"), dtype=torch.float32, device=hidden.device)
    topi = torch.full((splits, n, max(topk, 1)), -1, dtype=torch.int32, device=hidden.device)
    args = (hidden, weight, bias if bias is not None else hidden, labels, partials, topv, topi,
            n, v, d, splits, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            1.0 / temperature)
    meta = dict(HAS_BIAS=bias is not None, TOPK=topk, TOPK_PAD=topk_pad, PRECISION=_precision(hidden.dtype))
    if interpreting():
        tiles = INTERPRETER_TILES
        grid = (triton.cdiv(n, tiles["BLOCK_N"]), splits)
        _forward_kernel[grid](*args, **meta, **tiles)
    else:
        grid = lambda cfg: (triton.cdiv(n, cfg["BLOCK_N"]), splits)  # noqa: E731
        _forward_tuned[grid](*args, **meta)
    stats = combine_partials(partials)
    if not topk:
        return stats, (None, None)
    values = topv.permute(1, 0, 2).reshape(n, splits * topk)
    indices = topi.permute(1, 0, 2).reshape(n, splits * topk).long()
    top_values, pos = torch.topk(values, topk, dim=1)
    return stats, (top_values, torch.gather(indices, 1, pos))


def grad_backward(hidden, weight, bias, labels, temperature, logsumexp, entropy, g, e):
    """Same contract as the twin's ``grad_backward``: (dh, dW, db) in the input dtypes."""
    n, d = hidden.shape
    v = weight.shape[0]
    dh = torch.zeros(n, d, dtype=torch.float32, device=hidden.device)
    dw = torch.zeros(v, d, dtype=torch.float32, device=hidden.device)
    db = torch.zeros(v if bias is not None else 1, dtype=torch.float32, device=hidden.device)
    args = (hidden, weight, bias if bias is not None else hidden, labels, logsumexp.contiguous(),
            entropy.contiguous(), g.contiguous(), e.contiguous(), dh, dw, db,
            n, v, d, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            1.0 / temperature)
    meta = dict(HAS_BIAS=bias is not None, PRECISION=_precision(hidden.dtype))
    if interpreting():
        tiles = INTERPRETER_TILES
        grid = (triton.cdiv(n, tiles["BLOCK_N"]), triton.cdiv(v, tiles["BLOCK_V"]))
        _backward_kernel[grid](*args, **meta, **tiles)
    else:
        grid = lambda cfg: (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(v, cfg["BLOCK_V"]))  # noqa: E731
        _backward_tuned[grid](*args, **meta)
    return (dh.to(hidden.dtype), dw.to(weight.dtype),
            None if bias is None else db.to(bias.dtype))
