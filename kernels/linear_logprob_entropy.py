"""Fused vocabulary kernel in Triton: log-prob of the label, entropy, vocabulary covariance and top-k
straight from hidden states and the LM head, forward and backward, never materializing N×V logits.

Forward (``_forward_kernel``): one pass over the vocabulary. Program (row block, vocabulary split)
computes each [BLOCK_N, BLOCK_V] logits tile with ``tl.dot`` over BLOCK_D chunks of D into fp32 and
folds it into the streaming accumulators of docs/kernels.md §1 (running max from −inf; columns past V
are −inf). The covariance sums (s2, u2) and the running top-k are compile-time switches (COV, TOPK),
so a logprob+entropy call pays for neither. Splits write O(N) partials that ``_stats.combine_partials``
merges exactly, so a few thousand tokens still fill the GPU. Programs are ordered in groups of
GROUP_N row blocks per split (the matmul tutorial's swizzle), so the programs running at once share
tiles of W and H in L2.

Backward (``_dz_kernel`` + ``_workspace.gemm_backward``): no atomics. For a chunk of R tokens (R from
the workspace budget) the kernel recomputes the logits tile by tile, forms
dz = g·(1[v=y] − p) − e·p·(log p + H), scales by 1/T and stores it in the input dtype into a
[R, V] buffer; cuBLAS then computes dH[chunk] = dZ·W and dW += dZᵀ·H[chunk] in place.

Offsets into hidden, W and the dZ buffer are int64 (N·V and V·D pass 2³¹ at 7B–32B). Autotuning is
keyed on N rounded up to a power of two, so a new batch size does not re-tune.

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (then with small fixed tiles).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastcov.kernels._stats import combine_partials
from fastcov.kernels._workspace import chunk_rows, gemm_backward, workspace_bytes


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _grouped_program(pid, n_blocks_a, n_blocks_b, GROUP: tl.constexpr):
    """Map a linear program id to (a, b) so that GROUP consecutive a-blocks sweep b together."""
    per_group = GROUP * n_blocks_b
    group = pid // per_group
    first_a = group * GROUP
    size = tl.minimum(n_blocks_a - first_a, GROUP)
    a = first_a + (pid % per_group) % size
    b = (pid % per_group) // size
    return a, b


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, D, stride_hn, stride_hd,
                 stride_wv, stride_wd, inv_temp,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 tempered logits of a [BLOCK_N, BLOCK_V] tile; masked rows/columns hold finite garbage.
    ``rows``/``cols`` are int64 so the pointer offsets cannot wrap."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    h_rows = h_ptr + rows[:, None] * stride_hn
    w_cols = w_ptr + cols[:, None] * stride_wv
    for d0 in range(0, D, BLOCK_D):
        dk = d0 + offs_d
        dmask = dk < D
        h = tl.load(h_rows + dk[None, :] * stride_hd, mask=row_mask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(w_cols + dk[None, :] * stride_wd, mask=col_mask[:, None] & dmask[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temp


@triton.jit
def _forward_kernel(h_ptr, w_ptr, b_ptr, y_ptr, part_ptr, topv_ptr, topi_ptr,
                    N, V, D, SPLITS, N_BUCKET, stride_hn, stride_hd, stride_wv, stride_wd, inv_temp,
                    HAS_BIAS: tl.constexpr, COV: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                    PRECISION: tl.constexpr, GROUP_N: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n, pid_s = _grouped_program(tl.program_id(0), tl.cdiv(N, BLOCK_N), SPLITS, GROUP_N)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
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
        cols = v0.to(tl.int64) + tl.arange(0, BLOCK_V)
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
        u = scale * (u + shift * s) + tl.sum(e * zc, axis=1)
        s = scale * s + tl.sum(e, axis=1)
        if COV:
            e2 = e * e
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

    base = part_ptr + pid_s.to(tl.int64) * N + rows
    stride_stat = SPLITS * N
    tl.store(base, m, mask=row_mask)
    tl.store(base + stride_stat, s, mask=row_mask)
    tl.store(base + 2 * stride_stat, u, mask=row_mask)
    tl.store(base + 3 * stride_stat, s2, mask=row_mask)
    tl.store(base + 4 * stride_stat, u2, mask=row_mask)
    tl.store(base + 5 * stride_stat, zy, mask=row_mask)
    if TOPK > 0:
        offs = (pid_s.to(tl.int64) * N + rows)[:, None] * TOPK + slot[None, :]
        kmask = row_mask[:, None] & (slot[None, :] < TOPK)
        tl.store(topv_ptr + offs, top_v, mask=kmask)
        tl.store(topi_ptr + offs, top_i, mask=kmask)


@triton.jit
def _dz_kernel(h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, g_ptr, e_ptr, dz_ptr,
               N, V, D, N_BUCKET, stride_hn, stride_hd, stride_wv, stride_wd, inv_temp,
               HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, GROUP_N: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """dZ [N, V] (row stride V, input dtype) of a chunk of N tokens: each program one tile, no atomics."""
    pid_n, pid_v = _grouped_program(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
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
    dz = dz * inv_temp
    tl.store(dz_ptr + rows[:, None] * V + cols[None, :], dz.to(dz_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


# Hopper (H100/H200) search spaces; untuned until a GPU run lands (bench/kernels.py --preset h100).
def _forward_configs():
    configs = []
    for bn, bv in ((64, 128), (128, 64), (128, 128), (128, 256)):
        for bd in (32, 64):
            for warps, stages in ((4, 3), (8, 3), (8, 4)):
                configs.append(triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_D": bd},
                                             num_warps=warps, num_stages=stages))
    return configs


def _dz_configs():
    configs = []
    for bn, bv in ((64, 128), (128, 128), (128, 256)):
        for bd in (32, 64):
            for warps, stages in ((4, 4), (8, 3), (8, 4)):
                configs.append(triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_D": bd},
                                             num_warps=warps, num_stages=stages))
    return configs


_forward_tuned = triton.autotune(configs=_forward_configs(),
                                 key=["N_BUCKET", "V", "D", "SPLITS"])(_forward_kernel)
_dz_tuned = triton.autotune(configs=_dz_configs(), key=["N_BUCKET", "V", "D"])(_dz_kernel)

# Small fixed tiles for the CPU interpreter (slow: every tile is numpy).
INTERPRETER_TILES = {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_D": 16}
GROUP_N = 8
# Fill the dZ buffer with NaN before each launch (always under the interpreter; on a GPU with
# FASTCOV_POISON=1, as `pytest -m gpu` sets): an unwritten tile then shows in dH and dW.
POISON = os.environ.get("FASTCOV_POISON", "0") not in ("", "0")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def n_bucket(n: int) -> int:
    """The autotuning key for N: the next power of two (at least 64)."""
    return max(64, triton.next_power_of_2(max(n, 1)))


def _default_splits(n: int, v: int, device: torch.device) -> int:
    """Vocabulary splits so that about four programs per SM are in flight; each keeps ≥ 8 tiles."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    row_blocks = triton.cdiv(n, 128)
    return max(1, min(triton.cdiv(4 * sms, row_blocks), triton.cdiv(v, 8 * 128)))


def stats_forward(hidden, weight, bias, labels, temperature, topk, want_cov=True, workspace=None, splits=None):
    """Same contract as the twin's ``stats_forward``: ([6, N] fp32 stats, (topk logits, topk indices)).
    s2 and u2 are zero unless ``want_cov``. ``workspace`` is accepted for symmetry (the forward's
    extra memory is O(N·splits))."""
    n, d = hidden.shape
    v = weight.shape[0]
    splits = splits or _default_splits(n, v, hidden.device)
    # NaN poison: an element the kernel fails to write shows up in every output
    partials = torch.full((6, splits, n), float("nan"), dtype=torch.float32, device=hidden.device)
    topk_pad = triton.next_power_of_2(topk) if topk else 1
    topv = torch.full((splits, n, max(topk, 1)), float("nan"), dtype=torch.float32, device=hidden.device)
    topi = torch.full((splits, n, max(topk, 1)), -1, dtype=torch.int32, device=hidden.device)
    args = (hidden, weight, bias if bias is not None else hidden, labels, partials, topv, topi,
            n, v, d, splits, n_bucket(n), hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            1.0 / temperature)
    meta = dict(HAS_BIAS=bias is not None, COV=bool(want_cov), TOPK=topk, TOPK_PAD=topk_pad,
                PRECISION=_precision(hidden.dtype), GROUP_N=GROUP_N)
    if interpreting():
        tiles = INTERPRETER_TILES
        _forward_kernel[(triton.cdiv(n, tiles["BLOCK_N"]) * splits,)](*args, **meta, **tiles)
    else:
        grid = lambda cfg: (triton.cdiv(n, cfg["BLOCK_N"]) * splits,)  # noqa: E731
        _forward_tuned[grid](*args, **meta)
    stats = combine_partials(partials)
    if not topk:
        return stats, (None, None)
    values = topv.permute(1, 0, 2).reshape(n, splits * topk)
    indices = topi.permute(1, 0, 2).reshape(n, splits * topk).long()
    top_values, pos = torch.topk(values, topk, dim=1)
    return stats, (top_values, torch.gather(indices, 1, pos))


def grad_backward(hidden, weight, bias, labels, temperature, logsumexp, entropy, g, e, workspace=None,
                  need_dh=True, need_dw=True):
    """Same contract as the twin's ``grad_backward``: (dh, dW, db) in the input dtypes.

    Workspace: one dZ buffer of R·V input-dtype elements, R = ``chunk_rows`` of the budget
    (``workspace`` bytes, default ``workspace_bytes()``); the kernel's fp32 tiles live in registers.
    """
    n, d = hidden.shape
    v = weight.shape[0]
    budget = workspace or workspace_bytes()
    rows = chunk_rows(n, v, hidden.element_size(), budget, bias is not None)
    logsumexp, entropy, g, e = (t.contiguous() for t in (logsumexp, entropy, g, e))
    inv_temp = 1.0 / temperature
    meta = dict(HAS_BIAS=bias is not None, PRECISION=_precision(hidden.dtype), GROUP_N=GROUP_N)

    def fill_dz(r0, r1, dz):
        m = r1 - r0
        if POISON or interpreting():
            dz.fill_(float("nan"))  # poison: a tile the kernel skips cannot pass silently
        args = (hidden[r0:r1], weight, bias if bias is not None else hidden, labels[r0:r1], logsumexp[r0:r1],
                entropy[r0:r1], g[r0:r1], e[r0:r1], dz, m, v, d, n_bucket(m),
                hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), inv_temp)
        if interpreting():
            tiles = INTERPRETER_TILES
            grid = (triton.cdiv(m, tiles["BLOCK_N"]) * triton.cdiv(v, tiles["BLOCK_V"]),)
            _dz_kernel[grid](*args, **meta, **tiles)
        else:
            grid = lambda cfg: (triton.cdiv(m, cfg["BLOCK_N"]) * triton.cdiv(v, cfg["BLOCK_V"]),)  # noqa: E731
            _dz_tuned[grid](*args, **meta)

    return gemm_backward(hidden, weight, bias, fill_dz, rows, need_dh, need_dw)
