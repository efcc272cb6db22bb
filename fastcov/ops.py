"""Public ops: log-prob of the sampled token, entropy, vocabulary covariance and top-k.

``linear_logprob_entropy`` works from hidden states and the LM head and never materializes the N×V
logits; ``logprob_entropy_from_logits`` gives the same outputs to callers that already hold logits.
"""

from __future__ import annotations

import importlib
import math
from typing import NamedTuple

import torch

IMPLS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LogprobEntropy(NamedTuple):
    """Per-token outputs, shaped like ``labels`` (``[..., k]`` for top-k); all fp32 but topk_index.

    logprob, entropy: differentiable w.r.t. hidden, weight and bias. logsumexp: log Z of the tempered
    logits. vocab_cov: κ = Cov_{a∼π}(log π(a), e_y(a) − π(a)), no gradient. topk_logprob/topk_index:
    the k most likely tokens (descending), no gradient. Rows whose label is ignore_index have
    logprob = entropy = vocab_cov = 0.
    """

    logprob: torch.Tensor
    entropy: torch.Tensor | None
    logsumexp: torch.Tensor
    vocab_cov: torch.Tensor | None
    topk_logprob: torch.Tensor | None
    topk_index: torch.Tensor | None


def _check_scalar_args(temperature, topk, vocab_size, impl=None):
    if isinstance(temperature, torch.Tensor):
        temperature = float(temperature)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 0:
        raise ValueError(f"topk must be a non-negative int, got {topk!r}")
    if topk > vocab_size:
        raise ValueError(f"topk={topk} exceeds the vocabulary size V={vocab_size}")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return float(temperature)


def _check_labels(labels, expected_shape, device, vocab_size, ignore_index):
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 (or int32), got {labels.dtype}")
    if tuple(labels.shape) != tuple(expected_shape):
        raise ValueError(f"labels shape {tuple(labels.shape)} must be {tuple(expected_shape)}")
    if labels.device != device:
        raise ValueError(f"labels is on {labels.device} but the other inputs are on {device}")
    if labels.numel():
        bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
        if bool(bad.any()):
            example = int(labels[bad][0])
            raise ValueError(
                f"labels must be in [0, {vocab_size}) or ignore_index={ignore_index}; found {example}"
            )


def _validate(hidden, weight, labels, bias, temperature, ignore_index, topk, impl):
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, D] or [B, T, D], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, float16 or bfloat16, got {hidden.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, D], got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    vocab_size, dim = weight.shape
    if vocab_size < 1 or dim < 1:
        raise ValueError(f"weight must have V >= 1 and D >= 1, got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != dim:
        raise ValueError(f"hidden's last dim {hidden.shape[-1]} must equal weight's D={dim}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (vocab_size,):
            raise ValueError(f"bias shape {tuple(bias.shape)} must be ({vocab_size},)")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must match hidden dtype {hidden.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden is on {hidden.device}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    temperature = _check_scalar_args(temperature, topk, vocab_size, impl)
    _check_labels(labels, hidden.shape[:-1], hidden.device, vocab_size, ignore_index)
    return temperature


def _triton_backend(device: torch.device):
    """The Triton kernels module, or a ValueError that says why they can't run here."""
    try:
        backend = importlib.import_module("fastcov.kernels.linear_logprob_entropy")
    except ImportError as exc:
        raise ValueError(f"impl='triton' needs the triton package, which failed to import: {exc}") from exc
    if device.type == "cuda" or (device.type == "cpu" and backend.interpreting()):
        return backend
    raise ValueError(
        f"impl='triton' runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1; "
        f"got tensors on {device}. Use impl='torch' or impl='auto'."
    )


def kernel_backend(impl: str, device: torch.device):
    """The module implementing ``stats_forward``/``grad_backward`` for ``impl`` on ``device``: the
    Triton kernels or the PyTorch twin ("auto": Triton on CUDA, the twin elsewhere)."""
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return importlib.import_module("fastcov.kernels.linear_logprob_entropy_torch")
    if impl == "auto":
        try:
            return _triton_backend(device)
        except ValueError:
            return importlib.import_module("fastcov.kernels.linear_logprob_entropy_torch")
    return _triton_backend(device)


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    entropy: bool = True,
    vocab_cov: bool = False,
    topk: int = 0,
    impl: str = "auto",
    workspace_mb: float | None = None,
) -> LogprobEntropy:
    """Log-prob of the label, entropy (and optionally κ and top-k) of softmax((hidden·Wᵀ + b)/T).

    hidden: [N, D] or [B, T, D], fp32/fp16/bf16. weight: [V, D], same dtype and device. bias: [V] or
    None. labels: int64 shaped like hidden without D; ignore_index rows give zeros and no gradient.
    impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the chunked PyTorch twin, any
    device) or "auto" (Triton on CUDA, the twin elsewhere). workspace_mb: the backward's scratch
    budget in MiB (default: $FASTCOV_WORKSPACE_MB, else 256); it walks the tokens in chunks of
    R = ⌊budget / (V·itemsize)⌋ rows (see ``fastcov.kernels._workspace``). Returns a ``LogprobEntropy``.
    """
    temperature = _validate(hidden, weight, labels, bias, temperature, ignore_index, topk, impl)
    from fastcov.kernels._workspace import workspace_bytes

    workspace = workspace_bytes(workspace_mb)
    backend = kernel_backend(impl, hidden.device)
    batch_shape = labels.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    labels1d = labels.reshape(-1).to(torch.int64).contiguous()
    from fastcov.kernels._autograd import LinearLogprobEntropyFunction

    logprob, ent, lse, kappa, top_logprob, top_index = LinearLogprobEntropyFunction.apply(
        hidden2d, weight, bias, labels1d, temperature, ignore_index, bool(vocab_cov), topk, backend, workspace
    )
    return LogprobEntropy(
        logprob=logprob.view(batch_shape),
        entropy=ent.view(batch_shape) if entropy else None,
        logsumexp=lse.view(batch_shape),
        vocab_cov=kappa.view(batch_shape) if vocab_cov else None,
        topk_logprob=top_logprob.view(*batch_shape, topk) if topk else None,
        topk_index=top_index.view(*batch_shape, topk) if topk else None,
    )


def logprob_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    entropy: bool = True,
    vocab_cov: bool = False,
    topk: int = 0,
) -> LogprobEntropy:
    """The outputs of ``linear_logprob_entropy`` from logits [..., V] (any float dtype) the caller holds.

    Computed in fp32 with autograd; gradients flow to ``logits`` through logprob and entropy.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    vocab_size = logits.shape[-1]
    temperature = _check_scalar_args(temperature, topk, vocab_size)
    _check_labels(labels, logits.shape[:-1], logits.device, vocab_size, ignore_index)
    valid = labels != ignore_index
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp_all = z - lse.unsqueeze(-1)
    index = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(-1)
    zero = torch.zeros_like(lse)
    logprob = torch.where(valid, logp_all.gather(-1, index).squeeze(-1).clamp(max=0.0), zero)
    p = torch.exp(logp_all)
    ent = torch.where(valid, (-(p * logp_all).sum(-1)).clamp(min=0.0, max=math.log(vocab_size)), zero)
    kappa = top_logprob = top_index = None
    if vocab_cov:
        with torch.no_grad():
            p2 = p * p
            h = ent.detach()
            lp = logprob.detach()
            kappa = torch.exp(lp) * (lp + h) - ((p2 * logp_all).sum(-1) + h * p2.sum(-1))
            kappa = torch.where(valid, kappa, zero)
    if topk:
        with torch.no_grad():
            top_logprob, top_index = torch.topk(logp_all.detach(), topk, dim=-1)
    return LogprobEntropy(logprob, ent if entropy else None, lse.detach(), kappa, top_logprob, top_index)
