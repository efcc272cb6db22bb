"""The autograd Function shared by both implementations of the fused vocabulary kernel.

``backend`` is a module with ``stats_forward`` and ``grad_backward`` (the Triton kernels in
``linear_logprob_entropy`` or the twin in ``linear_logprob_entropy_torch``): the forward keeps only
O(N) statistics, the backward recomputes the logits tiles.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from fastcov.kernels._stats import finalize


class LinearLogprobEntropyFunction(torch.autograd.Function):
    """(hidden [N, D], weight [V, D], bias [V] | None, labels [N] int64) ->
    logprob [N], entropy [N], logsumexp [N], vocab_cov [N] (empty unless asked), topk values [N, k],
    topk indices [N, k]; all fp32 except indices (int64). Gradients flow through logprob and entropy."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, temperature: float, ignore_index: int, want_cov: bool, topk: int,
                backend: ModuleType, workspace: int | None = None) -> tuple[torch.Tensor, ...]:
        stats, (top_z, top_index) = backend.stats_forward(hidden, weight, bias, labels, temperature, topk,
                                                          want_cov=want_cov, workspace=workspace)
        valid = labels != ignore_index
        logsumexp, logprob, entropy, vocab_cov = finalize(stats, valid, weight.shape[0], want_cov)
        if topk:
            top_logprob = top_z - logsumexp[:, None]
        else:
            top_logprob = logprob.new_empty(0)
            top_index = labels.new_empty(0)
        if vocab_cov is None:
            vocab_cov = logprob.new_empty(0)
        ctx.save_for_backward(hidden, weight, bias, labels, logsumexp, entropy, valid)
        ctx.temperature = temperature
        ctx.backend = backend
        ctx.workspace = workspace
        ctx.mark_non_differentiable(logsumexp, vocab_cov, top_logprob, top_index)
        return logprob, entropy, logsumexp, vocab_cov, top_logprob, top_index

    @staticmethod
    def backward(ctx: Any, g_logprob: torch.Tensor | None, g_entropy: torch.Tensor | None,
                 *_: Any) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, logsumexp, entropy, valid = ctx.saved_tensors
        zero = torch.zeros_like(logsumexp)
        g = zero if g_logprob is None else torch.where(valid, g_logprob.float(), zero)
        e = zero if g_entropy is None else torch.where(valid, g_entropy.float(), zero)
        dh, dw, db = ctx.backend.grad_backward(
            hidden, weight, bias, labels, ctx.temperature, logsumexp, entropy, g, e, workspace=ctx.workspace,
            need_dh=ctx.needs_input_grad[0], need_dw=ctx.needs_input_grad[1],
        )
        return (dh, dw, db if bias is not None and ctx.needs_input_grad[2] else None,
                None, None, None, None, None, None, None)


class VocabParallelLogprobEntropyFunction(torch.autograd.Function):
    """The same outputs when the LM head is split by vocabulary over the ranks of ``group``
    (Megatron/verl tensor parallelism): rank r holds rows [r·V_local, (r+1)·V_local) of W, labels are
    global ids. Each rank streams its shard; the [6, N] partial statistics are all-gathered and
    combined exactly; in the backward each rank forms dW for its shard and dh is summed over ranks.

    (hidden [N, D], weight [V_local, D], labels [N] int64) -> logprob [N], entropy [N], logsumexp [N].
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                ignore_index: int, group: Any, backend: ModuleType,
                workspace: int | None = None) -> tuple[torch.Tensor, ...]:
        import torch.distributed as dist

        from fastcov.kernels._stats import combine_partials

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local_labels = labels - rank * weight.shape[0]
        stats, _ = backend.stats_forward(hidden, weight, None, local_labels, temperature, 0, want_cov=False,
                                         workspace=workspace)
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats.contiguous(), group=group)
        combined = combine_partials(torch.stack(gathered, dim=1))
        valid = labels != ignore_index
        logsumexp, logprob, entropy, _ = finalize(combined, valid, weight.shape[0] * world, False)
        ctx.save_for_backward(hidden, weight, local_labels, logsumexp, entropy, valid)
        ctx.temperature, ctx.group, ctx.backend, ctx.workspace = temperature, group, backend, workspace
        ctx.mark_non_differentiable(logsumexp)
        return logprob, entropy, logsumexp

    @staticmethod
    def backward(ctx: Any, g_logprob: torch.Tensor | None, g_entropy: torch.Tensor | None,
                 _: Any) -> tuple[torch.Tensor | None, ...]:
        import torch.distributed as dist

        hidden, weight, local_labels, logsumexp, entropy, valid = ctx.saved_tensors
        zero = torch.zeros_like(logsumexp)
        g = zero if g_logprob is None else torch.where(valid, g_logprob.float(), zero)
        e = zero if g_entropy is None else torch.where(valid, g_entropy.float(), zero)
        dh, dw, _ = ctx.backend.grad_backward(
            hidden, weight, None, local_labels, ctx.temperature, logsumexp, entropy, g, e,
            workspace=ctx.workspace, need_dw=ctx.needs_input_grad[1],
        )
        # every rank must join the all-reduce, so dh is formed even when hidden needs no gradient
        dh32 = dh.float()
        dist.all_reduce(dh32, group=ctx.group)
        return (dh32.to(hidden.dtype) if ctx.needs_input_grad[0] else None, dw,
                None, None, None, None, None, None)
