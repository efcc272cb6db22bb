"""The backward's workspace budget and the GEMM-shaped driver both implementations share.

The backward never holds N×V of anything. It walks the tokens in chunks of R rows; for each chunk a
backend fills dZ [R, V] (the gradient of the tempered logits, recomputed from hidden and W, fp32
inside, stored in the input dtype) and two matmuls consume it:

    dH[chunk]  = dZ · W          written once, straight into the output
    dW        += dZᵀ · H[chunk]  accumulated in place, in the weight's dtype (no fp32 copy of W)
    db        += Σ_rows dZ       fp32 [V]

The workspace is the dZ buffer, R·V·itemsize bytes (plus 4·V bytes for db with a bias); R is the
largest row count whose buffer fits the budget (at least one row):

    R = clamp(⌊(budget − 4·V·[bias]) / (V·itemsize)⌋, 1, N), rounded down to a multiple of 64 when ≥ 128

The budget is ``workspace_mb`` when given, else the environment variable FASTCOV_WORKSPACE_MB,
else 256 MiB. At the Qwen2.5-7B head (V 152064, bf16) 256 MiB gives chunks of 832 tokens, 32 MiB
chunks of 110 (docs/kernels.md §3).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

DEFAULT_WORKSPACE_MB = 256.0
WORKSPACE_ENV = "FASTCOV_WORKSPACE_MB"
MiB = 1 << 20


def check_workspace_mb(value, name: str = "workspace_mb") -> float:
    """A positive finite number of MiB, or a ValueError/TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of MiB, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of MiB > 0, got {value}")
    return float(value)


def workspace_bytes(workspace_mb: float | None = None) -> int:
    """The backward's workspace budget in bytes: the argument, else $FASTCOV_WORKSPACE_MB, else 256 MiB."""
    if workspace_mb is None:
        raw = os.environ.get(WORKSPACE_ENV, "").strip()
        if raw:
            try:
                parsed = float(raw)
            except ValueError:
                raise ValueError(f"{WORKSPACE_ENV} must be a number of MiB, got {raw!r}") from None
            workspace_mb = check_workspace_mb(parsed, WORKSPACE_ENV)
        else:
            workspace_mb = DEFAULT_WORKSPACE_MB
    return max(1, int(check_workspace_mb(workspace_mb) * MiB))


def chunk_rows(n: int, v: int, itemsize: int, budget: int, has_bias: bool = False) -> int:
    """Rows R per backward chunk so that the dZ buffer R·V·itemsize (+ 4·V for db) fits ``budget`` bytes."""
    rows = (budget - (4 * v if has_bias else 0)) // (v * itemsize)
    rows = max(1, min(n, rows))
    if 128 <= rows < n:
        rows -= rows % 64  # whole GEMM tiles for the matmuls
    return rows


FillDz = Callable[[int, int, torch.Tensor], None]


def gemm_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fill_dz: FillDz,
                  rows: int, need_dh: bool = True, need_dw: bool = True):
    """(dh [N, D] | None, dW [V, D] | None, db [V] | None) in the inputs' dtypes.

    ``fill_dz(r0, r1, dz)`` writes the gradient of the loss w.r.t. the logits (1/T applied) of rows
    [r0, r1) into ``dz`` [r1 − r0, V] (input dtype); ``rows`` is the chunk size from ``chunk_rows``.
    """
    n = hidden.shape[0]
    v = weight.shape[0]
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_dh else None
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else None
    if dw is not None and n == 0:
        dw.zero_()
    db = torch.zeros(v, dtype=torch.float32, device=hidden.device) if bias is not None else None
    dz_buffer = torch.empty(min(rows, max(n, 1)), v, dtype=hidden.dtype, device=hidden.device)
    for i, r0 in enumerate(range(0, n, rows)):
        r1 = min(n, r0 + rows)
        dz = dz_buffer[: r1 - r0]
        fill_dz(r0, r1, dz)
        if dh is not None:
            torch.mm(dz, weight, out=dh[r0:r1])
        if dw is not None:
            if i == 0:
                torch.mm(dz.T, hidden[r0:r1], out=dw)
            else:
                dw.addmm_(dz.T, hidden[r0:r1])
        if db is not None:
            db += dz.sum(0, dtype=torch.float32)
    return dh, dw, None if db is None or bias is None else db.to(bias.dtype)
