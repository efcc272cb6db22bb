"""Triton kernels for the batch covariance c_t and the Clip-Cov random candidate keys.

Two launches per call:

1. ``_masked_sums_kernel``: per-block float64 partial sums of A, logp and the valid count
   (the host only adds the few partials on device, so the result is deterministic; no atomics).
2. ``_covariance_keys_kernel``: reads the means from device memory (no host round trip, so a
   process group can all-reduce the sums in between) and writes c_t and, optionally, the random
   key of each token, hash(seed, global position), bit-identical to the plain-PyTorch twin in
   ``covariance_torch.py``.

Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from __future__ import annotations

import torch

from .covariance_torch import (
    HASH_SALT_HIGH,
    HASH_SALT_SEED,
    MASK32,
    MIX_MUL_1,
    MIX_MUL_2,
    compute_dtype,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional off Linux; impl="triton" then raises
    triton = None
    tl = None

BLOCK_SIZE = 1024


def triton_available() -> bool:
    return triton is not None


if triton is not None:
    # jit functions may only read globals that are constexpr
    _MASK32 = tl.constexpr(MASK32)
    _SALT_HIGH = tl.constexpr(HASH_SALT_HIGH)
    _SALT_SEED = tl.constexpr(HASH_SALT_SEED)
    _MUL_1 = tl.constexpr(MIX_MUL_1)
    _MUL_2 = tl.constexpr(MIX_MUL_2)

    @triton.jit
    def _mix32(x):
        # x: uint32; multiplications wrap modulo 2**32 (lowbias32)
        x = x ^ (x >> 16)
        x = x * tl.full((), _MUL_1, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full((), _MUL_2, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _masked_sums_kernel(
        adv_ptr,
        logp_ptr,
        valid_ptr,
        partials_ptr,
        n_elements,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = offsets < n_elements
        valid = (tl.load(valid_ptr + offsets, mask=in_range, other=0) != 0) & in_range
        adv = tl.load(adv_ptr + offsets, mask=valid, other=0.0).to(tl.float64)
        logp = tl.load(logp_ptr + offsets, mask=valid, other=0.0).to(tl.float64)
        tl.store(partials_ptr + pid * 3 + 0, tl.sum(adv, axis=0))
        tl.store(partials_ptr + pid * 3 + 1, tl.sum(logp, axis=0))
        tl.store(partials_ptr + pid * 3 + 2, tl.sum(valid.to(tl.float64), axis=0))

    @triton.jit
    def _covariance_keys_kernel(
        adv_ptr,
        logp_ptr,
        valid_ptr,
        means_ptr,
        seed_ptr,
        offset_ptr,
        cov_ptr,
        keys_ptr,
        n_elements,
        BLOCK: tl.constexpr,
        USE_FP64: tl.constexpr,
        WITH_KEYS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = offsets < n_elements
        valid = (tl.load(valid_ptr + offsets, mask=in_range, other=0) != 0) & in_range
        if USE_FP64:
            acc_dtype = tl.float64
        else:
            acc_dtype = tl.float32
        adv = tl.load(adv_ptr + offsets, mask=valid, other=0.0).to(acc_dtype)
        logp = tl.load(logp_ptr + offsets, mask=valid, other=0.0).to(acc_dtype)
        mean_adv = tl.load(means_ptr).to(acc_dtype)
        mean_logp = tl.load(means_ptr + 1).to(acc_dtype)
        cov = tl.where(valid, (adv - mean_adv) * (logp - mean_logp), 0.0)
        tl.store(cov_ptr + offsets, cov.to(cov_ptr.dtype.element_ty), mask=in_range)
        if WITH_KEYS:
            seed = tl.load(seed_ptr)
            position = tl.load(offset_ptr) + offsets
            seed_low = (seed & _MASK32).to(tl.uint32)
            seed_high = ((seed >> 32) & _MASK32).to(tl.uint32)
            index_low = (position & _MASK32).to(tl.uint32)
            index_high = ((position >> 32) & _MASK32).to(tl.uint32)
            salt_low = _mix32(seed_low ^ _mix32(index_high ^ tl.full((), _SALT_HIGH, tl.uint32)))
            salt_high = _mix32(seed_high ^ tl.full((), _SALT_SEED, tl.uint32))
            key = _mix32(_mix32(index_low ^ salt_low) ^ salt_high)
            tl.store(keys_ptr + offsets, key.to(tl.int64), mask=in_range)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("impl='triton' needs the triton package, which is not installed")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1)


def _valid_bytes(valid: torch.Tensor) -> torch.Tensor:
    # Triton reads bool tensors most portably as uint8.
    return _flat(valid).view(torch.uint8)


def masked_sums_triton(advantages: torch.Tensor, logprob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Triton version of ``masked_sums_torch``.

    Args:
        advantages, logprob: floating tensors of the same shape (any float dtype).
        valid: bool tensor of that shape.
    Returns:
        float64 tensor [3] on the inputs' device: (Σ A, Σ logp, n_valid) over valid tokens.
    """
    _require_triton()
    n = valid.numel()
    n_blocks = max(1, triton.cdiv(n, BLOCK_SIZE))
    partials = torch.empty((n_blocks, 3), dtype=torch.float64, device=valid.device)
    _masked_sums_kernel[(n_blocks,)](
        _flat(advantages), _flat(logprob), _valid_bytes(valid), partials, n, BLOCK=BLOCK_SIZE
    )
    return partials.sum(dim=0)


def covariance_and_keys_triton(
    advantages: torch.Tensor,
    logprob: torch.Tensor,
    valid: torch.Tensor,
    means: torch.Tensor,
    seed: torch.Tensor | None = None,
    index_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of ``covariance_and_keys_torch`` (same arguments, same results).

    Args:
        advantages, logprob: floating tensors of the same shape.
        valid: bool tensor of that shape.
        means: float64 tensor [2] on device = (mean A, mean logp).
        seed: int64 tensor [1] on device; when given, random keys are returned too.
        index_offset: int64 scalar tensor on device, global position of the first element (default 0).
    Returns:
        (covariance [float32 or float64], int64 keys or None), shaped like logprob.
    """
    _require_triton()
    n = valid.numel()
    device = valid.device
    dtype = compute_dtype(advantages, logprob)
    cov = torch.empty(n, dtype=dtype, device=device)
    with_keys = seed is not None
    if seed is not None:
        keys = torch.empty(n, dtype=torch.int64, device=device)
        seed_buf = seed.reshape(1).to(torch.int64)
        if index_offset is None:
            offset_buf = torch.zeros(1, dtype=torch.int64, device=device)
        else:
            offset_buf = index_offset.reshape(1).to(torch.int64)
    else:
        keys = seed_buf = offset_buf = cov  # unused pointers when WITH_KEYS is False
    if n > 0:
        _covariance_keys_kernel[(triton.cdiv(n, BLOCK_SIZE),)](
            _flat(advantages),
            _flat(logprob),
            _valid_bytes(valid),
            means.to(torch.float64).contiguous(),
            seed_buf,
            offset_buf,
            cov,
            keys,
            n,
            BLOCK=BLOCK_SIZE,
            USE_FP64=dtype == torch.float64,
            WITH_KEYS=with_keys,
        )
    cov = cov.reshape(valid.shape)
    return cov, (keys.reshape(valid.shape) if with_keys else None)
