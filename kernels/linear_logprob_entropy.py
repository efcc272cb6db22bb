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

Each tile's base pointers into hidden, W and the dZ buffer are formed with int64 arithmetic (N·V and
V·D pass 2³¹ at 7B–32B); offsets inside a tile are int32. Autotuning is keyed on N rounded up to a power
of two, so a new batch size does not re-tune; the configs are pruned per dtype and switches to those that
compile without register spills for sm_90a and sm_100a (``python -m bench.compile``, docs/kernels.md §7).

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
def _softcap(x, softcap):
    """cap·tanh(x/cap) from one exp (Triton's interpreter has no libdevice tanh): tanh(a) = sign(a)·(1 − e)/(1 + e)
    with e = exp(−2|a|), which is 0 for large |a| (never inf). The quotient is the approximate one (div.full,
    2 ulp): IEEE division is a slow-path call that ptxas keeps the whole tile live across (the dZ kernel spilled
    kilobytes with it)."""
    e = tl.exp(tl.abs(x) * (-2.0 / softcap))
    t = tl.fdiv(1.0 - e, 1.0 + e)
    return tl.where(x < 0, -t, t) * softcap


@triton.jit
def _logits_tile(h_base, w_base, b_base, offs_n, offs_v, n_left, v_left, D, stride_hn, stride_hd,
                 stride_wv, stride_wd, softcap,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 logits before the temperature, c = W·h + b (cap·tanh(c/cap) with SOFTCAP), of a [BLOCK_N, BLOCK_V]
    tile; rows/columns past the ends hold finite garbage. The caller multiplies by each row's 1/T.

    ``h_base``/``w_base``/``b_base`` are 64-bit pointers to the tile's first row and column (the caller
    forms them with int64 arithmetic once per tile); inside the tile every offset is int32, so no
    per-element 64-bit index lives in registers. The D loop advances the base pointers, not a tensor."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    # rows/columns past the ends read the last row/column again instead of carrying a mask tile
    # through the D loop: only the [BLOCK_D] mask of the last D step remains
    h_offs = tl.minimum(offs_n, n_left - 1)[:, None] * stride_hn + offs_d[None, :] * stride_hd
    w_offs = tl.minimum(offs_v, v_left - 1)[:, None] * stride_wv + offs_d[None, :] * stride_wd
    for d0 in range(0, D, BLOCK_D):
        dmask = (offs_d < D - d0)[None, :]
        h = tl.load(h_base + h_offs, mask=dmask, other=0.0)
        w = tl.load(w_base + w_offs, mask=dmask, other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        h_base += BLOCK_D * stride_hd
        w_base += BLOCK_D * stride_wd
    if HAS_BIAS:
        acc += tl.load(b_base + offs_v, mask=offs_v < v_left, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        acc = _softcap(acc, softcap)
    return acc


@triton.jit
def _label_logits(h_base, w_ptr, b_ptr, labels, offs_n, n_left, D, stride_hn, stride_hd, stride_wv, stride_wd,
                  inv_t, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """fp32 tempered logit of each row's label, cap·tanh((h·W[y] + b[y])/cap)/T: [BLOCK_N], a row-wise dot over D
    of h and the gathered rows W[y] (garbage where the label is out of range: the caller masks it). Run after the
    vocabulary loop, so neither its pointer tiles nor the labels are live beside the logits tile."""
    offs_d = tl.arange(0, BLOCK_D)
    y = tl.maximum(labels, 0).to(tl.int64)
    h_offs = tl.minimum(offs_n, n_left - 1)[:, None] * stride_hn + offs_d[None, :] * stride_hd
    w_rows = w_ptr + y[:, None] * stride_wv + offs_d[None, :] * stride_wd
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dmask = (offs_d < D - d0)[None, :]
        h = tl.load(h_base + h_offs, mask=dmask, other=0.0).to(tl.float32)
        w = tl.load(w_rows, mask=dmask, other=0.0).to(tl.float32)
        acc += tl.sum(h * w, axis=1)
        h_base += BLOCK_D * stride_hd
        w_rows += BLOCK_D * stride_wd
    if HAS_BIAS:
        acc += tl.load(b_ptr + y).to(tl.float32)
    if SOFTCAP:
        acc = _softcap(acc, softcap)
    return acc * inv_t


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _tile_sums(zc, COV: tl.constexpr):
    """Row sums Σe, Σe·zc (and Σe², Σe²·zc with COV) of e = exp(zc), as one multi-operand reduction,
    so each element's e is consumed where it is formed and no second tile-sized temporary stays live
    (at 128×256 the logits tile alone is 128 registers a thread). zc = −inf gives e = 0 and e·zc = 0."""
    e = tl.exp(zc)
    ez = e * tl.maximum(zc, -1.0e30)  # past V zc = −inf and e = 0: 0·(−1e30) = 0, with no mask tile
    if COV:
        e2 = e * e
        s_t, u_t, s2_t, u2_t = tl.reduce((e, ez, e2, ez * e), 1, _add4)
    else:
        s_t, u_t = tl.reduce((e, ez), 1, _add2)
        s2_t = s_t
        u2_t = u_t
    return s_t, u_t, s2_t, u2_t


@triton.jit
def _insert_topk(zc, m_ref, v0, top_v, top_i, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """Insert a tile's largest values (``zc`` = z − m_ref, −inf past V) into the running top-k (values
    as z, int32 column indices), each in place of the smallest kept value. Only columns above the row's
    current k-th value are candidates, and the loop runs as many times as the most candidates any row
    has (at most TOPK): a runtime loop, not TOPK unrolled copies of a tile-wide argmax."""
    slot = tl.arange(0, TOPK_PAD)
    local = tl.arange(0, BLOCK_V)
    kth = tl.min(top_v, axis=1) - m_ref
    zc = tl.where(zc > kth[:, None], zc, float("-inf"))
    rounds = tl.minimum(tl.max(tl.sum((zc > kth[:, None]).to(tl.int32), axis=1), axis=0), TOPK)
    for _ in range(0, rounds):
        best, best_at = tl.max(zc, axis=1, return_indices=True)
        worst, worst_at = tl.min(top_v, axis=1, return_indices=True)
        best_z = best + m_ref
        put = (slot[None, :] == worst_at[:, None]) & (best_z > worst)[:, None]
        top_v = tl.where(put, best_z[:, None], top_v)
        top_i = tl.where(put, (v0 + best_at)[:, None], top_i)
        zc = tl.where(local[None, :] == best_at[:, None], float("-inf"), zc)
    return top_v, top_i


@triton.jit
def _forward_kernel(h_ptr, w_ptr, b_ptr, y_ptr, t_ptr, part_ptr, topv_ptr, topi_ptr,
                    N, V, D, SPLITS, N_BUCKET, stride_hn, stride_hd, stride_wv, stride_wd, softcap,
                    HAS_BIAS: tl.constexpr, COV: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, GROUP_N: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n, pid_s = _grouped_program(tl.program_id(0), tl.cdiv(N, BLOCK_N), SPLITS, GROUP_N)
    row0 = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_v = tl.arange(0, BLOCK_V)
    n_left = N - row0
    row_mask = offs_n < n_left
    h_base = h_ptr + row0.to(tl.int64) * stride_hn
    # each row's 1/T (fp32 [N]; a scalar temperature arrives as N equal values), rows past N re-read the last
    inv_t = tl.load(t_ptr + row0.to(tl.int64) + tl.minimum(offs_n, n_left - 1))

    neg_inf = float("-inf")
    m = tl.full((BLOCK_N,), neg_inf, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    u = tl.zeros((BLOCK_N,), tl.float32)
    s2 = tl.zeros((BLOCK_N,), tl.float32)
    u2 = tl.zeros((BLOCK_N,), tl.float32)
    if TOPK > 0:
        slot = tl.arange(0, TOPK_PAD)
        # padding slots hold +inf so they are never the smallest kept value
        top_v = tl.where(slot[None, :] < TOPK, neg_inf, float("inf")) + tl.zeros((BLOCK_N, TOPK_PAD), tl.float32)
        top_i = tl.zeros((BLOCK_N, TOPK_PAD), tl.int32)

    tiles_per_split = tl.cdiv(tl.cdiv(V, BLOCK_V), SPLITS)
    for t in range(0, tiles_per_split):
        v0 = (pid_s * tiles_per_split + t) * BLOCK_V
        v_left = V - v0
        z = _logits_tile(h_base, w_ptr + v0.to(tl.int64) * stride_wv, b_ptr + v0.to(tl.int64), offs_n, offs_v,
                         n_left, v_left, D, stride_hn, stride_hd, stride_wv, stride_wd, softcap,
                         HAS_BIAS, SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION)
        z = tl.where((offs_v < v_left)[None, :], z * inv_t[:, None], neg_inf)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_ref = tl.where(m_new == neg_inf, 0.0, m_new)  # a split past V sees no column at all
        scale = tl.exp(m - m_ref)
        shift = tl.where(m == neg_inf, 0.0, m - m_ref)
        zc = z - m_ref[:, None]  # −inf past V: e = 0 there, and e·zc is taken as 0
        s_t, u_t, s2_t, u2_t = _tile_sums(zc, COV)
        u = scale * (u + shift * s) + u_t
        s = scale * s + s_t
        if COV:
            u2 = scale * scale * (u2 + shift * s2) + u2_t
            s2 = scale * scale * s2 + s2_t
        m = m_new
        if TOPK > 0:
            top_v, top_i = _insert_topk(zc, m_ref, v0, top_v, top_i, TOPK, TOPK_PAD, BLOCK_V)

    # the label's logit by its own dot after the loop, not a tile-wide compare inside it (registers);
    # split 0 reports it, the others −inf, so that combining the partials keeps it once
    labels = tl.load(y_ptr + row0.to(tl.int64) + offs_n, mask=row_mask, other=-1).to(tl.int32)
    zy = _label_logits(h_base, w_ptr, b_ptr, labels, offs_n, n_left, D, stride_hn, stride_hd, stride_wv, stride_wd,
                       inv_t, softcap, HAS_BIAS, SOFTCAP, BLOCK_N, BLOCK_D)
    zy = tl.where((labels >= 0) & (labels < V) & (pid_s == 0), zy, neg_inf)
    base = part_ptr + pid_s.to(tl.int64) * N + row0
    stride_stat = (pid_s * 0 + SPLITS).to(tl.int64) * N  # SPLITS may arrive as the constant 1
    tl.store(base + offs_n, m, mask=row_mask)
    tl.store(base + stride_stat + offs_n, s, mask=row_mask)
    tl.store(base + 2 * stride_stat + offs_n, u, mask=row_mask)
    tl.store(base + 3 * stride_stat + offs_n, s2, mask=row_mask)
    tl.store(base + 4 * stride_stat + offs_n, u2, mask=row_mask)
    tl.store(base + 5 * stride_stat + offs_n, zy, mask=row_mask)
    if TOPK > 0:
        k_base = (pid_s.to(tl.int64) * N + row0) * TOPK
        offs = offs_n[:, None] * TOPK + slot[None, :]
        kmask = row_mask[:, None] & (slot[None, :] < TOPK)
        tl.store(topv_ptr + k_base + offs, top_v, mask=kmask)
        tl.store(topi_ptr + k_base + offs, top_i, mask=kmask)


@triton.jit
def _dz_kernel(h_ptr, w_ptr, b_ptr, y_ptr, t_ptr, lse_ptr, ent_ptr, g_ptr, e_ptr, dz_ptr,
               N, V, D, N_BUCKET, stride_hn, stride_hd, stride_wv, stride_wd, softcap,
               HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, GROUP_N: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """dZ [N, V] (row stride V, input dtype) of a chunk of N tokens: each program one tile, no atomics. dZ is the
    gradient w.r.t. W·h + b: dz/T, times 1 − tanh² of the cap with SOFTCAP."""
    pid_n, pid_v = _grouped_program(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)
    row0 = pid_n * BLOCK_N
    v0 = pid_v * BLOCK_V
    offs_n = tl.arange(0, BLOCK_N)
    offs_v = tl.arange(0, BLOCK_V)
    n_left = N - row0
    v_left = V - v0
    row_mask = offs_n < n_left
    rows = row0.to(tl.int64) + offs_n
    c = _logits_tile(h_ptr + row0.to(tl.int64) * stride_hn, w_ptr + v0.to(tl.int64) * stride_wv,
                     b_ptr + v0.to(tl.int64), offs_n, offs_v, n_left, v_left, D, stride_hn, stride_hd,
                     stride_wv, stride_wd, softcap, HAS_BIAS, SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION)
    # the row vectors are read after the matmul, so they are not live across the D loop
    labels = tl.load(y_ptr + rows, mask=row_mask, other=-1).to(tl.int32) - v0
    inv_t = tl.load(t_ptr + rows, mask=row_mask, other=1.0)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_mask, other=0.0)
    e = tl.load(e_ptr + rows, mask=row_mask, other=0.0)
    logp = c * inv_t[:, None] - lse[:, None]
    dz = -(g[:, None] + e[:, None] * (logp + ent[:, None])) * tl.exp(logp)
    dz += tl.where(offs_v[None, :] == labels[:, None], g[:, None], 0.0)
    dz = dz * inv_t[:, None]
    if SOFTCAP:
        # the cap's derivative 1 − tanh², tanh = c/cap = (log p + log Z)·T/cap: from log p, which is live here
        # anyway, not from c (keeping c until now made a third live tile, which spilled)
        t = (logp + lse[:, None]) * (1.0 / (softcap * inv_t))[:, None]
        dz = dz * (1.0 - t * t)
    dz_base = dz_ptr + row0.to(tl.int64) * V + v0
    tl.store(dz_base + offs_n[:, None] * V + offs_v[None, :], dz.to(dz_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (offs_v < v_left)[None, :])


# The autotune spaces (untuned for speed until a GPU run lands; python -m bench.kernels --preset h100). Each
# config is spill-free on sm_90a and sm_100a for the dtype and switches it is offered to, as compiled
# by `python -m bench.compile` (bench/results/compile/); 4-warp variants of the same tiles spilled
# and were pruned. (BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages):
_FWD_WIDE = ((256, 128, 32, 8, 3), (256, 128, 32, 8, 4))  # log-prob and entropy only (no COV, no top-k)
_FWD_LARGE = ((128, 128, 32, 8, 4),)
_FWD_MEDIUM = ((64, 128, 64, 8, 3), (64, 128, 32, 8, 4), (128, 64, 64, 8, 3), (128, 64, 32, 8, 4))
# fp32 inputs take the exact (FMA, no tensor core) dot: only tiles small enough for its registers
_FP32 = ((64, 64, 32, 8, 3), (64, 64, 32, 8, 4), (32, 64, 32, 4, 3), (32, 64, 32, 4, 4))
_DZ = ((256, 128, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
       (128, 128, 32, 8, 4))
# with the soft cap the dZ epilogue keeps a third tile live (tanh beside log p and dz): 256×128 spilled kilobytes and
# 128×128 with 4 warps 32–188 B, so the cap takes the tiles that stay spill-free with it
_DZ_SOFTCAP = ((128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4), (128, 64, 64, 8, 3))


# Every config allows all 255 registers: without the explicit .maxnreg, ptxas for sm_100a caps some of
# these kernels at 128 registers and spills (e.g. the fp32 64×64 forward: 20 B at 128 regs, 0 B at 158).
MAXNREG = 255


def _as_configs(space):
    return [triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_D": bd}, num_warps=w, num_stages=st,
                          maxnreg=MAXNREG) for bn, bv, bd, w, st in space]


def forward_space(dtype: str, topk: int = 0, bias: bool = False, cov: bool = False, arch: int = 90,
                  softcap: bool = False) -> tuple:
    """The forward's configs for an input dtype name, switches and compute capability (``arch``: 80, 90,
    100). On sm_90a/sm_100a the 256×128 tile is spill-free for log-prob and entropy alone (it spills with
    the covariance sums or the top-k, and on sm_90a with a bias and the soft cap: 8 B), and the 128×128 tile
    unless both of those are on (sm_100a) or the top-k meets a bias and the soft cap (sm_100a: 20 B); sm_80's mma
    path has fewer registers to spare (256×128 spills there, and 128×128 with the top-k: 4 B since each row's 1/T
    is a vector)."""
    if dtype == "float32":
        return _FP32
    space: tuple[tuple[int, int, int, int, int], ...] = _FWD_MEDIUM
    large = (not (cov and topk) and not (arch < 90 and topk)
             and not (arch >= 100 and topk and bias and softcap))
    if large:
        space = _FWD_LARGE + space
    if not cov and not topk and arch >= 90 and not (arch < 100 and bias and softcap):
        space = _FWD_WIDE + space
    return space


def dz_space(dtype: str, arch: int = 90, softcap: bool = False) -> tuple:
    """The dZ kernel's configs for an input dtype name and the soft cap: spill-free on every arch (``arch`` is
    taken so that the compile table calls every space alike)."""
    if dtype == "float32":
        return _FP32
    return _DZ_SOFTCAP if softcap else _DZ


def _dtype_name(named_args) -> str:
    return str(named_args["h_ptr"].dtype).removeprefix("torch.")


def _arch(named_args) -> int:
    """The launch device's compute capability as 80/90/100 (90 off CUDA: the interpreter)."""
    device = named_args["h_ptr"].device
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _prune_forward(configs, named_args, **kwargs):
    keep = set(forward_space(_dtype_name(named_args), kwargs.get("TOPK", 0), kwargs.get("HAS_BIAS", False),
                             kwargs.get("COV", False), _arch(named_args), kwargs.get("SOFTCAP", False)))
    return [c for c in configs if _key(c) in keep]


def _prune_dz(configs, named_args, **kwargs):
    keep = set(dz_space(_dtype_name(named_args), _arch(named_args), kwargs.get("SOFTCAP", False)))
    return [c for c in configs if _key(c) in keep]


def _key(config) -> tuple:
    kw = config.kwargs
    return kw["BLOCK_N"], kw["BLOCK_V"], kw["BLOCK_D"], config.num_warps, config.num_stages


# The switches that decide the pruned space are part of the key: keyed on the shape alone, a first call without the
# covariance sums cached the 256×128 tile, and a later call with them on the same shape reused it (it spills there).
_forward_tuned = triton.autotune(configs=_as_configs(dict.fromkeys(_FWD_WIDE + _FWD_LARGE + _FWD_MEDIUM + _FP32)),
                                 key=["N_BUCKET", "V", "D", "SPLITS", "HAS_BIAS", "COV", "TOPK", "SOFTCAP"],
                                 prune_configs_by={"early_config_prune": _prune_forward})(_forward_kernel)
_dz_tuned = triton.autotune(configs=_as_configs(dict.fromkeys(_DZ + _DZ_SOFTCAP + _FP32)),
                            key=["N_BUCKET", "V", "D", "HAS_BIAS", "SOFTCAP"],
                            prune_configs_by={"early_config_prune": _prune_dz})(_dz_kernel)



def autotune_picks() -> list[dict]:
    """The configs the autotuners have picked in this process, one dict per cached key: kernel name, the key
    (N bucket, V, D[, splits, bias, covariance, top-k], then the tensor dtypes, as Triton builds it) and the
    config, labelled as ``bench/results/compile`` labels it (``BLOCK_N x BLOCK_V x BLOCK_D / warps, stages``)."""
    picks = []
    for kernel, tuner in (("_forward_kernel", _forward_tuned), ("_dz_kernel", _dz_tuned)):
        for key, cfg in dict(getattr(tuner, "cache", {})).items():
            meta = {k: cfg.kwargs[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_D")}
            picks.append({"kernel": f"linear_logprob_entropy.{kernel}", "key": [str(k) for k in key],
                          "config": "x".join(str(v) for v in meta.values()) + f"/w{cfg.num_warps}s{cfg.num_stages}",
                          "meta": meta, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return picks


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


def row_inv_temp(inv_temp: float | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """The kernels' per-row 1/T: fp32 [N] contiguous (a float becomes N equal values)."""
    if isinstance(inv_temp, float):
        return torch.full((n,), inv_temp, dtype=torch.float32, device=device)
    return inv_temp.to(torch.float32).contiguous()


def stats_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  inv_temp: float | torch.Tensor, topk: int, want_cov: bool = True, workspace: int | None = None,
                  splits: int | None = None, softcap: float | None = None, want_s2: bool = False,
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Same contract as the twin's ``stats_forward``: ([6, N] fp32 stats, (topk logits, topk indices)).
    s2 and u2 are zero unless ``want_cov`` or ``want_s2`` (the kernel's COV switch computes both: Σπ² alone
    takes the κ kernel). ``workspace`` is accepted for symmetry (the forward's extra memory is O(N·splits))."""
    n, d = hidden.shape
    v = weight.shape[0]
    splits = splits or _default_splits(n, v, hidden.device)
    # NaN poison: an element the kernel fails to write shows up in every output
    partials = torch.full((6, splits, n), float("nan"), dtype=torch.float32, device=hidden.device)
    topk_pad = triton.next_power_of_2(topk) if topk else 1
    topv = torch.full((splits, n, max(topk, 1)), float("nan"), dtype=torch.float32, device=hidden.device)
    topi = torch.full((splits, n, max(topk, 1)), -1, dtype=torch.int32, device=hidden.device)
    args = (hidden, weight, bias if bias is not None else hidden, labels, row_inv_temp(inv_temp, n, hidden.device),
            partials, topv, topi, n, v, d, splits, n_bucket(n), hidden.stride(0), hidden.stride(1), weight.stride(0),
            weight.stride(1), float(softcap or 1.0))
    meta = dict(HAS_BIAS=bias is not None, COV=bool(want_cov or want_s2), TOPK=topk, TOPK_PAD=topk_pad,
                SOFTCAP=softcap is not None, PRECISION=_precision(hidden.dtype), GROUP_N=GROUP_N)
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


def grad_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  inv_temp: float | torch.Tensor, logsumexp: torch.Tensor, entropy: torch.Tensor, g: torch.Tensor,
                  e: torch.Tensor, workspace: int | None = None, need_dh: bool = True, need_dw: bool = True,
                  softcap: float | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Same contract as the twin's ``grad_backward``: (dh, dW, db) in the input dtypes.

    Workspace: one dZ buffer of R·V input-dtype elements, R = ``chunk_rows`` of the budget
    (``workspace`` bytes, default ``workspace_bytes()``); the kernel's fp32 tiles live in registers.
    """
    n, d = hidden.shape
    v = weight.shape[0]
    budget = workspace or workspace_bytes()
    rows = chunk_rows(n, v, hidden.element_size(), budget, bias is not None)
    logsumexp, entropy, g, e = (t.contiguous() for t in (logsumexp, entropy, g, e))
    inv_t = row_inv_temp(inv_temp, n, hidden.device)
    meta = dict(HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, PRECISION=_precision(hidden.dtype),
                GROUP_N=GROUP_N)

    def fill_dz(r0, r1, dz):
        m = r1 - r0
        if POISON or interpreting():
            dz.fill_(float("nan"))  # poison: a tile the kernel skips cannot pass silently
        args = (hidden[r0:r1], weight, bias if bias is not None else hidden, labels[r0:r1], inv_t[r0:r1],
                logsumexp[r0:r1], entropy[r0:r1], g[r0:r1], e[r0:r1], dz, m, v, d, n_bucket(m),
                hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), float(softcap or 1.0))
        if interpreting():
            tiles = INTERPRETER_TILES
            grid = (triton.cdiv(m, tiles["BLOCK_N"]) * triton.cdiv(v, tiles["BLOCK_V"]),)
            _dz_kernel[grid](*args, **meta, **tiles)
        else:
            tuned_grid = lambda cfg: (triton.cdiv(m, cfg["BLOCK_N"]) * triton.cdiv(v, cfg["BLOCK_V"]),)  # noqa: E731
            _dz_tuned[tuned_grid](*args, **meta)

    return gemm_backward(hidden, weight, bias, fill_dz, rows, need_dh, need_dw)
