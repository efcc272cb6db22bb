"""Plain-PyTorch twin of ``kernels/covariance.py``: masked sums, token covariance and random keys.

Both implementations compute the same quantities with the same arithmetic, so either can back
``fastcov.covariance.token_covariance``; the random keys are bit-identical between them.

Random keys: a counter-based hash of (seed, global token position). It is a pure function of its
inputs, so every rank of a process group can compute the keys of its own tokens and they equal the
keys a single process would compute for the concatenated batch.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Salts that decorrelate the high-word and seed mixing stages (any odd-looking constants do).
HASH_SALT_HIGH = 0x243F6A88
HASH_SALT_SEED = 0x85A308D3
# lowbias32 multipliers (C. Wellons, "Prospecting for hash functions").
MIX_MUL_1 = 0x7FEB352D
MIX_MUL_2 = 0x846CA68B


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash, emulating uint32 arithmetic in int64.

    Args:
        x: int64 tensor with values in [0, 2**32).
    Returns:
        int64 tensor, same shape, values in [0, 2**32). A bijection on [0, 2**32).
    """
    # int64 products of two 32-bit values wrap modulo 2**64; the low 32 bits are exact.
    x = x ^ (x >> 16)
    x = (x * MIX_MUL_1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL_2) & MASK32
    return x ^ (x >> 16)


def random_keys_torch(seed: torch.Tensor, global_index: torch.Tensor) -> torch.Tensor:
    """Random sort keys for tokens, a deterministic function of (seed, global position).

    Args:
        seed: int64 tensor with one element, value in [0, 2**62).
        global_index: int64 tensor (any shape) of non-negative token positions.
    Returns:
        int64 tensor shaped like ``global_index``, values in [0, 2**32). For a fixed seed and a fixed
        ``global_index >> 32`` the map is a bijection of ``global_index & MASK32``, so keys of distinct
        positions in one batch of < 2**32 tokens never collide.
    """
    seed = seed.reshape(())
    seed_low = seed & MASK32
    seed_high = (seed >> 32) & MASK32
    index_low = global_index & MASK32
    index_high = (global_index >> 32) & MASK32
    salt_low = mix32(seed_low ^ mix32(index_high ^ HASH_SALT_HIGH))
    salt_high = mix32(seed_high ^ HASH_SALT_SEED)
    return mix32(mix32(index_low ^ salt_low) ^ salt_high)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 inputs are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def masked_sums_torch(advantages: torch.Tensor, logprob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sums over valid tokens, accumulated in float64.

    Args:
        advantages, logprob: floating tensors of the same shape.
        valid: bool tensor of that shape.
    Returns:
        float64 tensor [3]: (Σ advantages, Σ logprob, number of valid tokens).
    """
    a = torch.where(valid, advantages.to(torch.float64), 0.0)
    lp = torch.where(valid, logprob.to(torch.float64), 0.0)
    return torch.stack([a.sum(), lp.sum(), valid.sum().to(torch.float64)])


def covariance_and_keys_torch(
    advantages: torch.Tensor,
    logprob: torch.Tensor,
    valid: torch.Tensor,
    means: torch.Tensor,
    seed: torch.Tensor | None = None,
    index_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """c_t = (A_t − mean A)(logp_t − mean logp) on valid tokens, 0 elsewhere; optional random keys.

    Args:
        advantages, logprob: floating tensors of the same shape.
        valid: bool tensor of that shape.
        means: float64 tensor [2] = (mean A, mean logp).
        seed: int64 tensor [1]; when given, random keys are returned too.
        index_offset: int64 scalar tensor, global position of this tensor's first element (default 0).
    Returns:
        (covariance in float32, or float64 if an input is float64; int64 keys or None), shaped like logprob.
    """
    dtype = compute_dtype(advantages, logprob)
    mean_adv = means[0].to(dtype)
    mean_logp = means[1].to(dtype)
    cov = (advantages.to(dtype) - mean_adv) * (logprob.to(dtype) - mean_logp)
    cov = torch.where(valid, cov, 0.0)
    keys = None
    if seed is not None:
        position = torch.arange(valid.numel(), device=valid.device, dtype=torch.int64).reshape(valid.shape)
        if index_offset is not None:
            position = position + index_offset
        keys = random_keys_torch(seed, position)
    return cov, keys
