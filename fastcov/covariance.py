"""The paper's per-token covariance proxy c_t = (A_t − Ā)·(logp_t − mean logp).

Means are over valid tokens; with a process group they are over all its ranks (one all_reduce of
the sums and the count). logp is detached: c_t scores tokens for selection, it is not a loss term.

``impl`` chooses the backend: "triton" (kernels/covariance.py, CUDA or ``TRITON_INTERPRET=1``),
"torch" (the plain-PyTorch twin) or "auto" (Triton on CUDA tensors, the twin elsewhere).
"""

from __future__ import annotations

import torch

from fastcov.kernels import covariance as _triton_impl
from fastcov.kernels import covariance_torch as _torch_impl
from fastcov.selection import all_reduce_sum, check_like, global_offset

IMPLS = ("auto", "triton", "torch")


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and _triton_impl.triton_available() else "torch"
    return impl


def _check_inputs(logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> None:
    for name, tensor in (("logprob", logprob), ("advantages", advantages), ("mask", mask)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    for name, tensor in (("logprob", logprob), ("advantages", advantages)):
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {tensor.dtype}")
    check_like("advantages", advantages, logprob, "logprob")
    check_like("mask", mask, logprob, "logprob")


def token_covariance_and_keys(
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    seed: torch.Tensor | None = None,
    group=None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """c_t and, when ``seed`` is given, the Clip-Cov random keys of the same tokens, in one fused pass.

    Args:
        logprob: [B, T] (any shape) floating log-probabilities of the sampled tokens; detached here.
        advantages: same shape, floating.
        mask: same shape; nonzero/True marks valid tokens.
        seed: int64 [1] tensor on the inputs' device (see ``fastcov.selection.draw_seed``).
        group: optional process group for the means and the global token positions of the keys.
        impl: "auto" | "triton" | "torch".
    Returns:
        (cov, keys): cov is float32 (float64 if an input is float64), 0 on invalid tokens; keys are
        int64 hash(seed, global position) or None.
    """
    _check_inputs(logprob, advantages, mask)
    backend = _resolve_impl(impl, logprob.device)
    logprob = logprob.detach()
    advantages = advantages.detach()
    valid = mask.bool()
    if backend == "triton":
        sums = _triton_impl.masked_sums_triton(advantages, logprob, valid)
    else:
        sums = _torch_impl.masked_sums_torch(advantages, logprob, valid)
    sums = all_reduce_sum(sums, group)
    means = sums[:2] / sums[2].clamp(min=1.0)
    index_offset = None
    if seed is not None and group is not None:
        index_offset = global_offset(valid.numel(), valid.device, group)
    compute = (
        _triton_impl.covariance_and_keys_triton if backend == "triton" else _torch_impl.covariance_and_keys_torch
    )
    return compute(advantages, logprob, valid, means, seed, index_offset)


def token_covariance(
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    group=None,
    impl: str = "auto",
) -> torch.Tensor:
    """Per-token covariance c_t = (A_t − Ā)(logp_t − mean logp), means over valid tokens.

    Args:
        logprob: [B, T] (any shape) floating log-probabilities of the sampled tokens; detached here.
        advantages: same shape, floating (per-token advantages; broadcast sequence advantages first).
        mask: same shape; nonzero/True marks valid tokens.
        group: optional torch.distributed process group: means over all its ranks' valid tokens.
        impl: "auto" | "triton" | "torch".
    Returns:
        Tensor shaped like ``logprob``, float32 (float64 if an input is float64), 0 on invalid tokens,
        no gradient. An all-masked input gives all zeros.
    """
    cov, _ = token_covariance_and_keys(logprob, advantages, mask, group=group, impl=impl)
    return cov
