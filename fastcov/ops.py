"""Public ops: log-prob of the sampled token, entropy, vocabulary covariance, Σπ² and top-k.

``linear_logprob_entropy`` works from hidden states and the LM head and never materializes the N×V
logits; ``logprob_entropy_from_logits`` gives the same outputs to callers that already hold logits.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

IMPLS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LogprobEntropy(NamedTuple):
    """Per-token outputs, shaped like ``labels`` (``[..., k]`` for top-k); all fp32 but topk_index.

    logprob, entropy: differentiable w.r.t. hidden, weight and bias. logsumexp: log Z of the tempered
    logits. vocab_cov: κ = Cov_{a∼π}(log π(a), e_y(a) − π(a)), no gradient. topk_logprob/topk_index:
    the k most likely tokens (descending), no gradient. sum_p2: Σ_a π(a)² (the probability that two draws
    agree; verl's ``sum_pi_squared``), no gradient. Rows whose label is ignore_index have
    logprob = entropy = vocab_cov = sum_p2 = 0.
    """

    logprob: torch.Tensor
    entropy: torch.Tensor | None
    logsumexp: torch.Tensor
    vocab_cov: torch.Tensor | None
    topk_logprob: torch.Tensor | None
    topk_index: torch.Tensor | None
    sum_p2: torch.Tensor | None = None


@dataclass(frozen=True)
class VocabParallel:
    """A head split by vocabulary over the ranks of ``group`` (tensor parallelism), for ``vocab_parallel=``.

    group: the process group (None: the default group). start: the first vocabulary id of this rank's rows;
    None for equal shards in rank order (start = rank·V_local, Megatron's layout). vocab_size: the whole
    vocabulary; None gives world·V_local, and it is required with ``start``. reduce_hidden_grad: all-reduce
    the gradient of ``hidden`` over the group in the backward (the ranks' are partial sums over their
    columns); False when the caller's framework reduces it (Megatron's ``copy_to_tensor_model_parallel_region``
    does). Every rank passes the same hidden states and labels (global ids).
    """

    group: Any = None
    start: int | None = None
    vocab_size: int | None = None
    reduce_hidden_grad: bool = True


def _check_scalar_args(temperature, topk, vocab_size, impl=None, softcap=None):
    """Checks every argument but the temperature tensor's values (``_check_temperature``); returns the temperature
    as a float, or the tensor as given."""
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 0:
        temperature = float(temperature)
    if not isinstance(temperature, torch.Tensor):
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            raise TypeError(f"temperature must be a float or a tensor, got {type(temperature).__name__}")
        if not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"temperature must be finite and > 0, got {temperature}")
        temperature = float(temperature)
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 0:
        raise ValueError(f"topk must be a non-negative int, got {topk!r}")
    if topk > vocab_size:
        raise ValueError(f"topk={topk} exceeds the vocabulary size V={vocab_size}")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
        if not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap must be finite and > 0 (None for no cap), got {softcap}")
    return temperature


def _check_temperature(temperature: torch.Tensor, labels_shape, device) -> torch.Tensor:
    """A per-token temperature: floating, on ``device``, broadcastable to the labels' shape (a per-sequence value
    as [B, 1]), finite and > 0. Returns it broadcast to ``labels_shape``, fp32."""
    if not temperature.is_floating_point():
        raise TypeError(f"temperature must be a floating tensor, got {temperature.dtype}")
    if temperature.device != device:
        raise ValueError(f"temperature is on {temperature.device} but the other inputs are on {device}")
    try:
        full = torch.broadcast_to(temperature, tuple(labels_shape))
    except RuntimeError:
        raise ValueError(f"temperature shape {tuple(temperature.shape)} must broadcast to the labels' shape "
                         f"{tuple(labels_shape)} (one per token, or [B, 1] for one per sequence)") from None
    if temperature.numel() and not bool(((temperature > 0) & torch.isfinite(temperature)).all()):
        bad = temperature[~((temperature > 0) & torch.isfinite(temperature))].reshape(-1)[0]
        raise ValueError(f"temperature must be finite and > 0 everywhere, found {float(bad)}")
    return full.detach().to(torch.float32)


def _shard(vocab_parallel, local_vocab: int):
    """The kernel's ``Shard`` for ``vocab_parallel`` (a ProcessGroup or ``VocabParallel``), or None."""
    if vocab_parallel is None:
        return None
    import torch.distributed as dist

    from fastcov.kernels._autograd import Shard

    opts = vocab_parallel if isinstance(vocab_parallel, VocabParallel) else VocabParallel(group=vocab_parallel)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("vocab_parallel needs torch.distributed initialised (the head is split over a group)")
    try:
        world, rank = dist.get_world_size(opts.group), dist.get_rank(opts.group)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"vocab_parallel: not a process group this rank belongs to ({exc})") from exc
    if rank < 0:
        raise ValueError("vocab_parallel: this rank is not in the group")
    if opts.start is None:
        start, vocab_size = rank * local_vocab, world * local_vocab
        if opts.vocab_size is not None and opts.vocab_size != vocab_size:
            raise ValueError(f"vocab_parallel.vocab_size={opts.vocab_size} is not world·V_local = {vocab_size}: "
                             f"give start for unequal shards")
    else:
        if opts.vocab_size is None:
            raise ValueError("vocab_parallel.vocab_size is required with vocab_parallel.start")
        start, vocab_size = int(opts.start), int(opts.vocab_size)
        if start < 0 or start + local_vocab > vocab_size:
            raise ValueError(f"vocab_parallel: rows [{start}, {start + local_vocab}) of this rank's head do not "
                             f"fit the vocabulary of {vocab_size}")
    return Shard(opts.group, start, vocab_size, bool(opts.reduce_hidden_grad))


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


def _validate(hidden, weight, labels, bias, temperature, ignore_index, topk, impl, softcap=None, vocab_size=None):
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
    local_vocab, dim = weight.shape
    vocab_size = local_vocab if vocab_size is None else vocab_size
    if local_vocab < 1 or dim < 1:
        raise ValueError(f"weight must have V >= 1 and D >= 1, got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != dim:
        raise ValueError(f"hidden's last dim {hidden.shape[-1]} must equal weight's D={dim}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (local_vocab,):
            raise ValueError(f"bias shape {tuple(bias.shape)} must be ({local_vocab},)")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must match hidden dtype {hidden.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden is on {hidden.device}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    temperature = _check_scalar_args(temperature, topk, local_vocab, impl, softcap)
    _check_labels(labels, hidden.shape[:-1], hidden.device, vocab_size, ignore_index)
    if isinstance(temperature, torch.Tensor):
        temperature = _check_temperature(temperature, labels.shape, hidden.device)
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
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    entropy: bool = True,
    vocab_cov: bool = False,
    sum_p2: bool = False,
    topk: int = 0,
    softcap: float | None = None,
    vocab_parallel: Any = None,
    impl: str = "auto",
    workspace_mb: float | None = None,
) -> LogprobEntropy:
    """Log-prob of the label, entropy (and optionally κ, Σπ² and top-k) of softmax(cap·tanh((hidden·Wᵀ + b)/cap)/T).

    hidden: [N, D] or [B, T, D], fp32/fp16/bf16. weight: [V, D], same dtype and device. bias: [V] or
    None. labels: int64 shaped like hidden without D; ignore_index rows give zeros and no gradient.
    temperature: a float, or a tensor broadcastable to labels' shape (one T per token; [B, 1] for one per
    sequence), > 0; no gradient flows to it. softcap: Gemma 2's ``final_logit_softcapping``: the logits are
    cap·tanh(z/cap) before the temperature divides them (None: no cap). vocab_cov: κ, sum_p2: Σπ² per token
    (both without gradient). vocab_parallel: a process group (or ``VocabParallel``) whose ranks each pass
    their rows of a head split by vocabulary (``weight`` [V_local, D], ``bias`` [V_local]) and the same hidden
    and labels (global ids); every output is the whole vocabulary's, merged by one all_gather of
    (4 + [κ or Σπ²] + [κ] + 2·topk)·N fp32 per rank, and the backward all-reduces dh (N·D fp32) once.
    impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the chunked PyTorch twin, any
    device) or "auto" (Triton on CUDA, the twin elsewhere). workspace_mb: the backward's scratch
    budget in MiB (default: $FASTCOV_WORKSPACE_MB, else 256); it walks the tokens in chunks of
    R = ⌊budget / (V·itemsize)⌋ rows (see ``fastcov.kernels._workspace``). Returns a ``LogprobEntropy``.
    What each switch costs: docs/kernels.md §8.
    """
    shard = _shard(vocab_parallel, weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0)
    temperature = _validate(hidden, weight, labels, bias, temperature, ignore_index, topk, impl, softcap,
                            None if shard is None else shard.vocab_size)
    from fastcov.kernels._autograd import LinearLogprobEntropyFunction, Switches
    from fastcov.kernels._workspace import workspace_bytes

    workspace = workspace_bytes(workspace_mb)
    backend = kernel_backend(impl, hidden.device)
    batch_shape = labels.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    labels1d = labels.reshape(-1).to(torch.int64).contiguous()
    if isinstance(temperature, torch.Tensor):
        inv_temp: float | torch.Tensor = (1.0 / temperature.double()).float().reshape(-1).contiguous()
    else:
        inv_temp = 1.0 / temperature
    sw = Switches(ignore_index=ignore_index, want_cov=bool(vocab_cov), want_sum_p2=bool(sum_p2), topk=topk,
                  softcap=None if softcap is None else float(softcap), workspace=workspace)
    logprob, ent, lse, kappa, p2, top_logprob, top_index = LinearLogprobEntropyFunction.apply(
        hidden2d, weight, bias, labels1d, inv_temp, sw, backend, shard
    )
    return LogprobEntropy(
        logprob=logprob.view(batch_shape),
        entropy=ent.view(batch_shape) if entropy else None,
        logsumexp=lse.view(batch_shape),
        vocab_cov=kappa.view(batch_shape) if vocab_cov else None,
        topk_logprob=top_logprob.view(*batch_shape, topk) if topk else None,
        topk_index=top_index.view(*batch_shape, topk) if topk else None,
        sum_p2=p2.view(batch_shape) if sum_p2 else None,
    )


def logprob_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    entropy: bool = True,
    vocab_cov: bool = False,
    sum_p2: bool = False,
    topk: int = 0,
    softcap: float | None = None,
) -> LogprobEntropy:
    """The outputs of ``linear_logprob_entropy`` from logits [..., V] (any float dtype) the caller holds (the
    cap, then the temperature, are applied to them here).

    Computed in fp32 with autograd; gradients flow to ``logits`` through logprob and entropy.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    vocab_size = logits.shape[-1]
    temperature = _check_scalar_args(temperature, topk, vocab_size, softcap=softcap)
    _check_labels(labels, logits.shape[:-1], logits.device, vocab_size, ignore_index)
    valid = labels != ignore_index
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        z = z / _check_temperature(temperature, labels.shape, logits.device).unsqueeze(-1)
    else:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp_all = z - lse.unsqueeze(-1)
    index = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(-1)
    zero = torch.zeros_like(lse)
    logprob = torch.where(valid, logp_all.gather(-1, index).squeeze(-1).clamp(max=0.0), zero)
    p = torch.exp(logp_all)
    ent = torch.where(valid, (-(p * logp_all).sum(-1)).clamp(min=0.0, max=math.log(vocab_size)), zero)
    kappa = top_logprob = top_index = p2_sum = None
    if vocab_cov or sum_p2:
        with torch.no_grad():
            p2 = p * p
            if sum_p2:
                p2_sum = torch.where(valid, p2.sum(-1), zero)
            if vocab_cov:
                h = ent.detach()
                lp = logprob.detach()
                kappa = torch.exp(lp) * (lp + h) - ((p2 * logp_all).sum(-1) + h * p2.sum(-1))
                kappa = torch.where(valid, kappa, zero)
    if topk:
        with torch.no_grad():
            top_logprob, top_index = torch.topk(logp_all.detach(), topk, dim=-1)
    return LogprobEntropy(logprob, ent if entropy else None, lse.detach(), kappa, top_logprob, top_index, p2_sum)
