"""Rollouts to padded tensors, and token-budget micro-batches with the same count on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Sequence:
    """One rollout. ``old_logprob`` and ``advantage`` are filled in by the loop."""

    prompt: list[int]
    response: list[int]
    sample_logprob: list[float]
    group: int  # global prompt index within the step
    reward: float = 0.0
    advantage: float = 0.0
    old_logprob: list[float] | None = None

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


@dataclass
class MicroBatch:
    """Right-padded tensors, all [B, L] (``group`` [B]).

    input_ids int64; attention_mask int64; labels int64 (the next token at response-predicting
    positions, IGNORE elsewhere); mask fp32 (1 where labels is a response token); advantages,
    old_logprob fp32 (0 outside the mask). ``weight`` 0 marks a filler micro-batch whose loss is discarded.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprob: torch.Tensor
    group: torch.Tensor
    seq_index: list[int]
    weight: float = 1.0

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum().item())


def collate(seqs: list[Sequence], index: list[int], pad_id: int, device: torch.device,
            weight: float = 1.0) -> MicroBatch:
    L = max(len(s) for s in seqs)
    B = len(seqs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    labels = torch.full((B, L), IGNORE, dtype=torch.long)
    adv = torch.zeros((B, L))
    old = torch.zeros((B, L))
    for i, s in enumerate(seqs):
        full = s.prompt + s.response
        n, p = len(full), len(s.prompt)
        ids[i, :n] = torch.tensor(full)
        att[i, :n] = 1
        labels[i, p - 1 : n - 1] = torch.tensor(s.response)
        adv[i, p - 1 : n - 1] = s.advantage
        if s.old_logprob is not None:
            old[i, p - 1 : n - 1] = torch.tensor(s.old_logprob)
    mask = (labels != IGNORE).float()
    group = torch.tensor([s.group for s in seqs], dtype=torch.long)
    return MicroBatch(ids.to(device), att.to(device), labels.to(device), mask.to(device), adv.to(device),
                      old.to(device), group.to(device), list(index), weight)


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Greedy in-order packing: consecutive indices while rows x longest <= budget (>= 1 row each)."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            chunks.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        chunks.append(cur)
    return chunks


def equalize(chunks: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest chunks until there are ``count``; pad with empty chunks when rows run out."""
    chunks = [list(c) for c in chunks]
    while len(chunks) < count:
        big = max(range(len(chunks)), key=lambda j: len(chunks[j])) if chunks else None
        if big is None or len(chunks[big]) < 2:
            chunks.append([])
            continue
        c = chunks.pop(big)
        chunks[big:big] = [c[: len(c) // 2], c[len(c) // 2 :]]
    return chunks


def micro_batches(seqs: list[Sequence], budget: int, pad_id: int, device: torch.device) -> list[MicroBatch]:
    """Token-budget micro-batches; every data-parallel rank gets the same number (ZeRO needs matching
    collectives), a rank with too few rows runs weight-0 filler micro-batches."""
    import torch.distributed as dist

    chunks = pack([len(s) for s in seqs], budget) if seqs else []
    count = torch.tensor([len(chunks)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    chunks = equalize(chunks, max(1, int(count.item())))
    out = []
    for c in chunks:
        if c:
            out.append(collate([seqs[i] for i in c], c, pad_id, device))
        else:
            filler = seqs[:1] or [Sequence([pad_id], [pad_id], [0.0], 0)]
            out.append(collate(filler, [], pad_id, device, weight=0.0))
    return out
