"""Rollouts to padded tensors, and token-budget micro-batches with the same count on every rank.

Two layouts of a micro-batch (``micro_batches(..., packing=...)``):

* padded: one sequence per row, right padding; rows × longest ≤ budget.
* packed: several sequences concatenated in one row (first-fit decreasing into rows of
  ``row_capacity`` tokens), ``position_ids`` restarting at 0 at each sequence and at the trailing
  padding, so the model can confine attention to each sequence; rows × longest row ≤ budget.

Either way a micro-batch records where each sequence's response tokens sit (``spans``), so per-token
quantities move between the micro-batch layout [rows, L] and a per-sequence layout [S, T] (row s =
sequence s of the list given to ``micro_batches``, column t = its t-th response token):
``MicroBatch.to_sequences`` / ``MicroBatch.from_sequences``. The per-sequence layout does not
depend on the micro-batch split, which is what global-scope token selection needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastcov.trainer.runtime.distributed import all_reduce_

IGNORE = -100


@dataclass
class Sequence:
    """One rollout. ``old_logprob`` and ``advantage`` are filled in by the loop (``old_entropy`` /
    ``old_vocab_cov`` too, when the update needs them); per-response-token lists."""

    prompt: list[int]
    response: list[int]
    sample_logprob: list[float]
    group: int  # global prompt index within the step
    reward: float = 0.0
    advantage: float = 0.0
    old_logprob: list[float] | None = None
    old_entropy: list[float] | None = None
    old_vocab_cov: list[float] | None = None
    # Per-response-token advantages (REINFORCE++ with its KL penalty, PRIME); when set they replace
    # ``advantage`` token by token.
    token_advantages: list[float] | None = None
    # Per-response-token loss weights of the rollout correction (algo.rollout_correction), set after
    # ``old_logprob``; None: no correction.
    rollout_weight: list[float] | None = None
    # rollout.async: the step whose weights drew it (the engine's version); None: drawn by the policy as it is.
    policy_version: int | None = None
    # Σπ² of each response token's distribution under the policy of step 4 (algo.adv_estimator
    # optimal_token_baseline), from the same fused pass as ``old_logprob``.
    old_sum_p2: list[float] | None = None
    # The temperature the rollout sampled this sequence with: the policy's forward scores its tokens at it
    # (per token, through the fused kernel, when a micro-batch holds sequences sampled at different ones).
    temperature: float | None = None

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


@dataclass
class MicroBatch:
    """Right-padded tensors, all [B, L] (B rows; a row holds one sequence, or several when packed).

    input_ids int64; attention_mask int64 (1 on real tokens); labels int64 (the next token at
    response-predicting positions, IGNORE elsewhere); mask fp32 (1 where labels is a response token);
    advantages, old_logprob fp32 (0 outside the mask); position_ids int64 or None (packed only:
    positions restart at 0 at every sequence start and at the trailing padding).
    ``seq_index[i]`` is the index (in the list given to ``micro_batches``) of the i-th sequence held
    here and ``spans[i] = (row, start, n)`` the place of its response labels: row ``row``, columns
    ``start .. start + n - 1``. ``weight`` 0 marks a filler micro-batch whose loss is discarded.
    ``temperature``: the sequences' sampling temperature, a float when they share one (or None when none
    recorded it), else fp32 [B, L] with each sequence's on its positions (1 on padding).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprob: torch.Tensor
    seq_index: list[int]
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    weight: float = 1.0
    position_ids: torch.Tensor | None = None
    temperature: float | torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum().item())

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    def temperature_or(self, default: float) -> float | torch.Tensor:
        """The temperature to score these tokens at: the sequences' own (``temperature``), else ``default``."""
        return self.temperature if self.temperature is not None else default

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of ``PolicyModel.forward`` for this layout."""
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "labels": self.labels}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs

    def segment_ids(self) -> torch.Tensor | None:
        """int64 [B, L]: i + 1 on the response labels of the i-th sequence held here, 0 elsewhere; None unless
        packed (a row is then one sequence). ``policy_loss``'s ``segments``: GSPO's sequence ratio and the seq-*
        aggregations take each packed sequence on its own."""
        if not self.packed:
            return None
        out = torch.zeros(self.mask.shape, dtype=torch.long, device=self.mask.device)
        for i, (row, start, n) in enumerate(self.spans):
            out[row, start:start + n] = i + 1
        return out

    def _token_index(self, device: torch.device):
        """int64 [n] each: (row, column) in this micro-batch and (sequence, token) in the [S, T] layout."""
        rows: list[int] = []
        cols: list[int] = []
        seqs: list[int] = []
        toks: list[int] = []
        for si, (row, start, n) in zip(self.seq_index, self.spans, strict=True):
            rows += [row] * n
            cols += range(start, start + n)
            seqs += [si] * n
            toks += range(n)
        return tuple(torch.tensor(x, dtype=torch.long, device=device) for x in (rows, cols, seqs, toks))

    def to_sequences(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy ``values`` [B, L] (this layout) into ``out`` [S, T] at this micro-batch's sequences; returns ``out``."""
        rows, cols, seqs, toks = self._token_index(values.device)
        out[seqs, toks] = values[rows, cols].to(out.dtype)
        return out

    def from_sequences(self, per_seq: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of ``per_seq`` [S, T] in its own layout [B, L] (zero/False elsewhere)."""
        out = torch.zeros(self.mask.shape, dtype=per_seq.dtype, device=per_seq.device)
        rows, cols, seqs, toks = self._token_index(per_seq.device)
        out[rows, cols] = per_seq[seqs, toks]
        return out


def collate_rows(seqs: list[Sequence], rows: list[list[int]], index: list[int], pad_id: int,
                 device: torch.device, weight: float = 1.0, packed: bool = True) -> MicroBatch:
    """Rows of concatenated sequences: ``rows[r]`` lists positions in ``seqs`` (and ``index``) placed in row r.

    ``packed`` False requires one sequence per row and leaves ``position_ids`` None. A filler
    (``weight`` 0) records no sequences (empty ``seq_index`` and ``spans``).
    """
    B = len(rows)
    L = max(sum(len(seqs[i]) for i in row) for row in rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    pos = torch.zeros((B, L), dtype=torch.long)
    labels = torch.full((B, L), IGNORE, dtype=torch.long)
    adv = torch.zeros((B, L))
    old = torch.zeros((B, L))
    seq_index, spans = [], []
    for r, row in enumerate(rows):
        if not packed and len(row) != 1:
            raise ValueError(f"packed=False needs one sequence per row, row {r} has {len(row)}")
        at = 0
        for i in row:
            s = seqs[i]
            full = s.prompt + s.response
            n, p = len(full), len(s.prompt)
            ids[r, at : at + n] = torch.tensor(full)
            att[r, at : at + n] = 1
            pos[r, at : at + n] = torch.arange(n)
            labels[r, at + p - 1 : at + n - 1] = torch.tensor(s.response)
            adv[r, at + p - 1 : at + n - 1] = (s.advantage if s.token_advantages is None
                                                else torch.tensor(s.token_advantages))
            if s.old_logprob is not None:
                old[r, at + p - 1 : at + n - 1] = torch.tensor(s.old_logprob)
            if weight > 0:
                seq_index.append(index[i])
                spans.append((r, at + p - 1, len(s.response)))
            at += n
        pos[r, at:] = torch.arange(L - at)  # the padding is a segment of its own
    mask = (labels != IGNORE).float()
    return MicroBatch(ids.to(device), att.to(device), labels.to(device), mask.to(device), adv.to(device),
                      old.to(device), seq_index, spans, weight, pos.to(device) if packed else None,
                      _row_temperatures(seqs, rows, (B, L), device))


def _row_temperatures(seqs: list[Sequence], rows: list[list[int]], shape: tuple[int, int],
                      device: torch.device) -> float | torch.Tensor | None:
    """The micro-batch's ``temperature``: None when no sequence recorded one, the shared value when all did alike,
    else fp32 [B, L] holding each sequence's on its positions (a sequence that recorded none takes the first
    recorded value)."""
    held = [seqs[i].temperature for row in rows for i in row]
    recorded = [t for t in held if t is not None]
    if not recorded:
        return None
    if all(t == recorded[0] for t in held):
        return float(recorded[0])
    out = torch.ones(shape, dtype=torch.float32)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            t = seqs[i].temperature
            out[r, at : at + len(seqs[i])] = recorded[0] if t is None else t
            at += len(seqs[i])
    return out.to(device)


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


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices into rows whose lengths sum to <= capacity (a longer item gets a row
    of its own). Indices inside a row and rows (by first index) are in ascending order."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for r in range(len(rows)):
            if fill[r] + lengths[i] <= capacity:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    return sorted(sorted(row) for row in rows)


def equalize(chunks: list[list[list[int]]], count: int) -> list[list[list[int]]]:
    """Split the largest chunks (lists of rows of indices) until there are ``count``; a chunk of several
    rows splits between rows, a one-row chunk between its sequences. Pads with empty chunks when no
    chunk holds two sequences."""
    chunks = [[list(row) for row in c] for c in chunks]
    while len(chunks) < count:
        sizes = [sum(len(row) for row in c) for c in chunks]
        big = max(range(len(chunks)), key=lambda j: sizes[j]) if chunks else None
        if big is None or sizes[big] < 2:
            chunks.append([])
            continue
        c = chunks.pop(big)
        if len(c) >= 2:
            halves = [c[: len(c) // 2], c[len(c) // 2 :]]
        else:
            row = c[0]
            halves = [[row[: len(row) // 2]], [row[len(row) // 2 :]]]
        chunks[big:big] = halves
    return chunks


def micro_batches(seqs: list[Sequence], budget: int, pad_id: int, device: torch.device, *,
                  packing: bool = False, row_capacity: int | None = None) -> list[MicroBatch]:
    """Token-budget micro-batches; every data-parallel rank gets the same number (ZeRO needs matching
    collectives), a rank with too few sequences runs weight-0 filler micro-batches.

    Padded (``packing`` False): consecutive sequences, rows × longest ≤ ``budget``. Packed: sequences
    first-fit into rows of at most ``row_capacity`` tokens (default: the longest sequence, which
    bounds the attention cost of a row as padding would; one row per micro-batch needs
    ``row_capacity=budget``), then consecutive rows while rows × longest row ≤ ``budget``. A single
    sequence longer than ``budget`` still gets a micro-batch of its own.
    """
    if budget < 1:
        raise ValueError(f"micro_token_budget must be >= 1, got {budget}")
    lengths = [len(s) for s in seqs]
    if packing and seqs:
        capacity = row_capacity if row_capacity is not None else max(lengths)
        if capacity < 1:
            raise ValueError(f"row_capacity must be >= 1, got {capacity}")
        rows = pack_rows(lengths, min(capacity, budget))
    else:
        rows = [[i] for i in range(len(seqs))]
    chunks = [[rows[r] for r in c] for c in pack([sum(lengths[i] for i in row) for row in rows], budget)]
    count = torch.tensor([len(chunks)])
    all_reduce_(count, "max")
    chunks = equalize(chunks, max(1, int(count.item())))
    out = []
    for c in chunks:
        if c:
            flat = [i for row in c for i in row]
            where = {i: k for k, i in enumerate(flat)}
            local_rows = [[where[i] for i in row] for row in c]
            out.append(collate_rows([seqs[i] for i in flat], local_rows, flat, pad_id, device, packed=packing))
        else:
            filler = seqs[:1] or [Sequence([pad_id], [pad_id], [0.0], 0)]
            out.append(collate_rows(filler, [[0]], [0], pad_id, device, weight=0.0, packed=packing))
    return out


def sequence_tensors(seqs: list[Sequence], width: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Per-sequence layout [S, width] (width ≥ the longest response) of what the loop stored per sequence.

    Returns fp32 ``old_logprob``, ``advantages``, bool ``mask`` and, when every sequence has them,
    fp32 ``old_entropy`` / ``old_vocab_cov`` (0 / False past each response; all of them for no sequences).
    """
    S = len(seqs)
    longest = max((len(s.response) for s in seqs), default=0)
    if width < longest:
        raise ValueError(f"width {width} is shorter than the longest response ({longest})")
    out = {"mask": torch.zeros((S, width), dtype=torch.bool), "advantages": torch.zeros((S, width))}
    names = ("old_logprob", "old_entropy", "old_vocab_cov")
    for name in names:
        if all(getattr(s, name) is not None for s in seqs):  # vacuously for no sequences
            out[name] = torch.zeros((S, width))
    for i, s in enumerate(seqs):
        n = len(s.response)
        out["mask"][i, :n] = True
        out["advantages"][i, :n] = (s.advantage if s.token_advantages is None
                                    else torch.tensor(s.token_advantages, dtype=torch.float32))
        for name in names:
            if name in out:
                out[name][i, :n] = torch.tensor(getattr(s, name), dtype=torch.float32)
    return {k: v.to(device) for k, v in out.items()}
