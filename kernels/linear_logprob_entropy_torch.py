"""Plain-PyTorch twin of the fused vocabulary kernel: same statistics, same results, any device.

Forward: the logits are computed chunk by chunk (chunk_n tokens × chunk_v vocabulary columns, fp32)
and folded into the streaming statistics of ``_stats``; a handful of chunk-sized fp32 buffers are
alive at once, at most ``CHUNK_ELEMENTS`` elements each (and within the workspace budget).

Backward: the GEMM-shaped design of ``_workspace.gemm_backward``, as in the Triton path: token
chunks of R rows, dZ [R, V] in the input dtype, then dH = dZ·W and dW += dZᵀ·H as matmuls. Where
the Triton kernel keeps each logits tile in registers, the twin needs fp32 scratch; it gives half
the budget to the dZ buffer and half to the scratch (fp32 logits of R rows × a column slab, and the
slab of W in fp32), so its peak stays within the same budget.
"""

from __future__ import annotations

import torch

from fastcov.kernels._stats import combine_partials, dz_from_upstream
from fastcov.kernels._workspace import chunk_rows, gemm_backward, workspace_bytes

# About 1M fp32 elements per forward logits chunk: 4 MB, a handful of which are alive at once.
CHUNK_ELEMENTS = 1 << 20
MAX_CHUNK_V = 4096
# the backward's fp32 logits slab: 2 MiB, so that its four elementwise passes stay in cache
SLAB_ELEMENTS = 1 << 19
MIN_SLAB_COLS = 256
# fp32 buffers of a forward chunk alive at once (z, e, e2, the products), for the budget
FORWARD_LIVE_BUFFERS = 6


def chunk_sizes(n: int, v: int, chunk_elements: int = CHUNK_ELEMENTS,
                max_chunk_v: int = MAX_CHUNK_V) -> tuple[int, int]:
    """(chunk_n, chunk_v) of the forward: chunk_n·chunk_v ≤ chunk_elements (at least one row)."""
    chunk_v = max(1, min(v, max_chunk_v))
    chunk_n = max(1, min(n, chunk_elements // chunk_v))
    return chunk_n, chunk_v


def _tempered_logits(h, w, b, inv_temp, softcap=None):
    """fp32 logits z = cap·tanh((h Wᵀ + b)/cap)/T of one chunk (no cap when ``softcap`` is None): h [n, D],
    w [v, D] -> [n, v]; ``inv_temp`` 1/T as a float or fp32 [n] (one per row)."""
    z = h.float() @ w.float().T
    if b is not None:
        z.add_(b.float())
    if softcap is not None:
        z.mul_(1.0 / softcap).tanh_().mul_(softcap)
    return z.mul_(inv_temp if isinstance(inv_temp, float) else inv_temp[:, None])


def stats_forward(hidden, weight, bias, labels, inv_temp, topk, want_cov=True, workspace=None,
                  chunk_elements: int | None = None, max_chunk_v: int = MAX_CHUNK_V, softcap: float | None = None,
                  want_s2: bool = False):
    """Streaming statistics over the vocabulary.

    hidden [N, D], weight [V, D], bias [V] or None, labels [N] int64 (a label outside [0, V) is another
    shard's: its zy stays −inf); ``inv_temp`` 1/T, a float or fp32 [N]; ``softcap`` the cap of
    cap·tanh(z/cap) applied before the temperature, or None. Returns the combined stats [6, N] fp32 (see
    ``_stats.STAT_NAMES``; s2 is zero unless ``want_cov`` or ``want_s2``, u2 unless ``want_cov``) and, when
    topk > 0, (values [N, k] fp32 logits z, indices [N, k] int64), else (None, None).
    ``workspace``: budget in bytes (default: ``workspace_bytes()``); ``chunk_elements`` overrides
    the chunk size (tests).
    """
    n, v = hidden.shape[0], weight.shape[0]
    if chunk_elements is None:
        budget = workspace or workspace_bytes()
        chunk_elements = max(1, min(CHUNK_ELEMENTS, budget // (4 * FORWARD_LIVE_BUFFERS)))
    chunk_n, chunk_v = chunk_sizes(n, v, chunk_elements, max_chunk_v)
    stats = torch.empty(6, n, dtype=torch.float32, device=hidden.device)
    top_values = top_indices = None
    if topk:
        top_values = torch.empty(n, topk, dtype=torch.float32, device=hidden.device)
        top_indices = torch.empty(n, topk, dtype=torch.int64, device=hidden.device)
    for r0 in range(0, n, chunk_n):
        rows = slice(r0, min(n, r0 + chunk_n))
        h, y = hidden[rows], labels[rows]
        row_inv_temp = inv_temp if isinstance(inv_temp, float) else inv_temp[rows]
        running = None
        cand_v, cand_i = [], []
        for c0 in range(0, v, chunk_v):
            c1 = min(v, c0 + chunk_v)
            z = _tempered_logits(h, weight[c0:c1], None if bias is None else bias[c0:c1], row_inv_temp, softcap)
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
            s_ = e.sum(1)
            if want_cov:
                e2 = e * e
                s2_, u2_ = e2.sum(1), e2.mul_(zc).sum(1)
                del e2
            elif want_s2:  # Σπ² alone: Σe² as a row dot, no second buffer
                s2_, u2_ = torch.linalg.vecdot(e, e), torch.zeros_like(s_)
            else:
                s2_ = u2_ = torch.zeros_like(s_)
            u_ = e.mul_(zc).sum(1)  # in place: e is not needed after this
            part = torch.stack((m, s_, u_, s2_, u2_, zy))
            del zc, z, e
            running = part if running is None else combine_partials(torch.stack((running, part), 1))
            # keep the top-k candidate set small: fold as soon as it exceeds a few k
            if topk and sum(t.shape[1] for t in cand_v) > 4 * topk:
                tv, pos = torch.topk(torch.cat(cand_v, 1), topk, dim=1)
                cand_v, cand_i = [tv], [torch.gather(torch.cat(cand_i, 1), 1, pos)]
        assert running is not None  # v >= 1: one vocabulary chunk at least
        stats[:, rows] = running
        if top_values is not None and top_indices is not None:  # topk
            tv, pos = torch.topk(torch.cat(cand_v, 1), topk, dim=1)
            top_values[rows] = tv
            top_indices[rows] = torch.gather(torch.cat(cand_i, 1), 1, pos)
    return stats, (top_values, top_indices)


def backward_chunks(n: int, v: int, d: int, itemsize: int, budget: int, has_bias: bool,
                    softcap: bool = False) -> tuple[int, int]:
    """(rows, scratch columns) of the twin's backward: the dZ buffer gets half the budget, the fp32
    scratch (three [rows, cols] buffers, four with the soft cap's tanh slab, and the [cols, D] slab of W) the
    other half."""
    rows = chunk_rows(n, v, itemsize, budget // 2, has_bias)
    cols = (budget // 2) // (4 * ((4 if softcap else 3) * rows + d))
    # slabs of at most SLAB_ELEMENTS: the elementwise passes over a slab then run in cache
    cols = min(cols, max(MIN_SLAB_COLS, SLAB_ELEMENTS // rows))
    return rows, max(1, min(v, cols))


def grad_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  inv_temp: float | torch.Tensor, logsumexp: torch.Tensor, entropy: torch.Tensor, g: torch.Tensor,
                  e: torch.Tensor, workspace: int | None = None, need_dh: bool = True, need_dw: bool = True,
                  softcap: float | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of Σ g·logprob + e·entropy w.r.t. hidden, weight and bias, in their dtypes
    (None for bias when bias is None, and for what ``need_dh``/``need_dw`` turn off).

    g, e: [N] fp32, zero on ignored rows. logsumexp, entropy: [N] fp32 from the forward. ``inv_temp``: 1/T, a
    float or fp32 [N]; ``softcap``: as in ``stats_forward`` (its derivative 1 − tanh² joins dz).
    ``workspace``: budget in bytes for dZ plus scratch (default: ``workspace_bytes()``).
    """
    n, d = hidden.shape
    v = weight.shape[0]
    budget = workspace or workspace_bytes()
    rows, cols = backward_chunks(n, v, d, hidden.element_size(), budget, bias is not None, softcap is not None)
    per_row = inv_temp if isinstance(inv_temp, torch.Tensor) else None  # fp32 [N], or one float for all rows
    scalar = float(inv_temp) if per_row is None else 1.0

    # 1/T folded into the upstream gradients (dz/T = (g/T)·(…) − (e/T)·(…)): one pass less per tile
    g_t, e_t = (g * scalar, e * scalar) if per_row is None else (g * per_row, e * per_row)
    with_entropy = bool(e.ne(0).any())  # only log-probs need a gradient: skip the entropy term's passes

    scratch = torch.empty(rows * cols, dtype=torch.float32, device=hidden.device)  # reused by every slab
    # the soft cap's tanh slab: the fourth [rows, cols] buffer backward_chunks budgets for with a cap
    tanh_scratch = torch.empty(rows * cols, dtype=torch.float32, device=hidden.device) if softcap else None

    def scaled(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """``t`` [r1 − r0, ·] times each row's 1/T, in place."""
        return t.mul_(scalar) if per_row is None else t.mul_(per_row[r0:r1, None])

    def fill_dz(r0, r1, dz):
        # without a cap, 1/T folds into the hidden rows (and the bias); a cap comes before 1/T, so it cannot
        if softcap is None:  # a copy, scaled in place (.float() of fp32 input would be the input itself)
            h32 = scaled(hidden[r0:r1].to(torch.float32, copy=True), r0, r1)
        else:
            h32 = hidden[r0:r1].float()
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            shape = (r1 - r0, c1 - c0)
            z = torch.mm(h32, weight[c0:c1].float().T, out=scratch[: shape[0] * shape[1]].view(shape))
            sech2 = None
            if bias is not None:
                b32 = bias[c0:c1].float()
                if softcap is not None:
                    z.add_(b32)
                elif per_row is None:
                    z.add_(b32, alpha=scalar)
                else:
                    z.addr_(per_row[r0:r1], b32)  # z += (1/T_i)·b_v, in place
            if softcap is not None:
                assert tanh_scratch is not None
                t = torch.mul(z, 1.0 / softcap, out=tanh_scratch[: shape[0] * shape[1]].view(shape)).tanh_()
                scaled(torch.mul(t, softcap, out=z), r0, r1)
                sech2 = t.square_().neg_().add_(1.0)  # 1 − tanh², in place of t
            grad = dz_from_upstream(z, logsumexp[r0:r1], entropy[r0:r1], labels[r0:r1] - c0, g_t[r0:r1],
                                    e_t[r0:r1], with_entropy)
            if sech2 is not None:
                grad.mul_(sech2)
            dz[:, c0:c1].copy_(grad)
            del z, grad, sech2

    return gemm_backward(hidden, weight, bias, fill_dz, rows, need_dh, need_dw)
