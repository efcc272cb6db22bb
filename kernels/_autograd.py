"""The autograd Function shared by both implementations of the fused vocabulary kernel.

``backend`` is a module with ``stats_forward`` and ``grad_backward`` (the Triton kernels in
``linear_logprob_entropy`` or the twin in ``linear_logprob_entropy_torch``): the forward keeps only
O(N) statistics, the backward recomputes the logits tiles.

With a ``Shard`` the head is this rank's rows of a head split by vocabulary over a process group (tensor
parallelism: Megatron, verl, vLLM). Each rank streams its own rows; one ``all_gather`` of the per-row partials
(and the local top-k) merges them exactly (``_stats.combine_partials``), so every rank holds the whole
vocabulary's log Z, log p(y), entropy, κ, Σπ² and top-k. The backward needs nothing more from the others: dz of
the rank's columns gives its dW and db, and one ``all_reduce`` sums dh over the ranks (docs/kernels.md §8).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from fastcov.kernels._stats import combine_partials, finalize

# rows of the gathered buffer, in order: the stats always sent, then s2 (κ or Σπ²), u2 (κ), then the top-k
_ALWAYS = ("m", "s", "u", "zy")


@dataclass(frozen=True)
class Shard:
    """This rank's part of a vocabulary-parallel head: the group, its first vocabulary id, the whole vocabulary's
    size, and whether the backward all-reduces dh over the group (off when the caller's framework does, as
    Megatron's ``copy_to_tensor_model_parallel_region`` backward)."""

    group: Any
    start: int
    vocab_size: int
    reduce_hidden_grad: bool = True


@dataclass(frozen=True)
class Switches:
    """What the call asks for beyond log p and H (constant through forward and backward)."""

    ignore_index: int = -100
    want_cov: bool = False
    want_sum_p2: bool = False
    topk: int = 0
    softcap: float | None = None
    workspace: int | None = None


def _gather_partials(stats: torch.Tensor, top_z: torch.Tensor | None, top_index: torch.Tensor | None,
                     sw: Switches, shard: Shard):
    """One all_gather of this rank's partials [6, N] and top-k [N, k] → (combined stats [6, N], merged top-k z,
    global indices). Only the rows the call needs travel: 4 + (s2) + (u2) + 2k fp32 per token."""
    import torch.distributed as dist

    n = stats.shape[1]
    rows = [stats[0], stats[1], stats[2], stats[5]]
    if sw.want_cov or sw.want_sum_p2:
        rows.append(stats[3])
    if sw.want_cov:
        rows.append(stats[4])
    parts = [torch.stack(rows)]
    if sw.topk:
        assert top_z is not None and top_index is not None
        global_index = (top_index + shard.start).to(torch.int32)
        parts += [top_z.T, global_index.view(torch.float32).T]  # the int32 ids travel bit for bit
    local = torch.cat(parts).contiguous()
    world = dist.get_world_size(shard.group)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=shard.group)
    every = torch.stack(gathered, dim=1)  # [rows, world, N]
    zero = torch.zeros_like(every[0])
    s2 = every[4] if sw.want_cov or sw.want_sum_p2 else zero
    u2 = every[5] if sw.want_cov else zero
    combined = combine_partials(torch.stack((every[0], every[1], every[2], s2, u2, every[3])))
    if not sw.topk:
        return combined, None, None
    k0 = len(rows)
    values = every[k0:k0 + sw.topk].permute(2, 1, 0).reshape(n, world * sw.topk)
    ids = every[k0 + sw.topk:].contiguous().view(torch.int32).permute(2, 1, 0).reshape(n, world * sw.topk)
    top_values, pos = torch.topk(values, sw.topk, dim=1)
    return combined, top_values, torch.gather(ids.long(), 1, pos)


class LinearLogprobEntropyFunction(torch.autograd.Function):
    """(hidden [N, D], weight [V, D] (or this rank's [V_local, D] with a ``Shard``), bias [V] | None,
    labels [N] int64 (global ids), inv_temp (1/T: a float or fp32 [N])) ->
    logprob [N], entropy [N], logsumexp [N], vocab_cov [N], sum_p2 [N] (each empty unless asked),
    topk values [N, k], topk indices [N, k]; all fp32 except indices (int64). Gradients flow through logprob and
    entropy to hidden, weight and bias (never to the temperature)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, inv_temp: float | torch.Tensor, sw: Switches, backend: ModuleType,
                shard: Shard | None = None) -> tuple[torch.Tensor, ...]:
        local_labels = labels if shard is None or shard.start == 0 else labels - shard.start
        stats, (top_z, top_index) = backend.stats_forward(
            hidden, weight, bias, local_labels, inv_temp, sw.topk, want_cov=sw.want_cov, workspace=sw.workspace,
            softcap=sw.softcap, want_s2=sw.want_sum_p2)
        vocab_size = weight.shape[0]
        if shard is not None:
            stats, top_z, top_index = _gather_partials(stats, top_z, top_index, sw, shard)
            vocab_size = shard.vocab_size
        valid = labels != sw.ignore_index
        logsumexp, logprob, entropy, vocab_cov, sum_p2 = finalize(stats, valid, vocab_size, sw.want_cov,
                                                                  sw.want_sum_p2)
        empty = logprob.new_empty(0)
        if sw.topk:
            assert top_z is not None and top_index is not None
            top_logprob = top_z - logsumexp[:, None]
        else:
            top_logprob, top_index = empty, labels.new_empty(0)
        vocab_cov = empty if vocab_cov is None else vocab_cov
        sum_p2 = empty if sum_p2 is None else sum_p2
        temp_tensor = inv_temp if isinstance(inv_temp, torch.Tensor) else None
        ctx.save_for_backward(hidden, weight, bias, local_labels, logsumexp, entropy, valid, temp_tensor)
        ctx.inv_temp = None if temp_tensor is not None else inv_temp
        ctx.sw, ctx.backend, ctx.shard = sw, backend, shard
        ctx.mark_non_differentiable(logsumexp, vocab_cov, sum_p2, top_logprob, top_index)
        return logprob, entropy, logsumexp, vocab_cov, sum_p2, top_logprob, top_index

    @staticmethod
    def backward(ctx: Any, g_logprob: torch.Tensor | None, g_entropy: torch.Tensor | None,
                 *_: Any) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, local_labels, logsumexp, entropy, valid, temp_tensor = ctx.saved_tensors
        sw: Switches = ctx.sw
        shard: Shard | None = ctx.shard
        zero = torch.zeros_like(logsumexp)
        g = zero if g_logprob is None else torch.where(valid, g_logprob.float(), zero)
        e = zero if g_entropy is None else torch.where(valid, g_entropy.float(), zero)
        need_dh = ctx.needs_input_grad[0]
        dh, dw, db = ctx.backend.grad_backward(
            hidden, weight, bias, local_labels, temp_tensor if temp_tensor is not None else ctx.inv_temp,
            logsumexp, entropy, g, e, workspace=sw.workspace, need_dh=need_dh, need_dw=ctx.needs_input_grad[1],
            softcap=sw.softcap,
        )
        if dh is not None and shard is not None and shard.reduce_hidden_grad:
            import torch.distributed as dist

            # the ranks' dh are partial sums over their columns; summed in fp32, then cast back once
            dh32 = dh.float()
            dist.all_reduce(dh32, group=shard.group)
            dh = dh32.to(hidden.dtype)
        return (dh, dw, db if bias is not None and ctx.needs_input_grad[2] else None,
                None, None, None, None, None)
