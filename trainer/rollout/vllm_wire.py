"""What travels between fastcov and vLLM: flat weight chunks in vLLM's packed layout, the request bodies, and
vLLM's outputs turned into ``RolloutBatch``es.

Weights go through vLLM's own RL weight-transfer API; fastcov only decides what a chunk is: one
``weight_buckets`` bucket (a bounded run of whole tensors, gathered together under ZeRO-3), cast to the
rollout dtype (bf16) and laid out as one flat tensor in vLLM's packed layout (``pack_flat``: the tensors'
bytes back to back, the layout of vLLM's ``packed_tensor.pack_tensors``). Only what a checkpoint of the
model would hold travels: its non-persistent buffers (rotary ``inv_freq``, ...) are derived from the config,
and vLLM's ``load_weights``, which loads checkpoints, has no place for them (``derived_buffer_names``).

Log-probs: ``logprobs_mode="raw_logprobs"`` (both modes): vLLM's log-softmax of the raw logits, before
temperature, penalties and top-k/top-p; the engine returns the sampled token's value unchanged. At
temperature 1 (the paper's recipe) that is the policy's own log-prob; at another temperature it is the
temperature-1 value (docs/vllm.md). Names pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fastcov.trainer.rollout.base import RolloutBatch, SamplingParams, finish_rollouts
from fastcov.trainer.runtime.weight_buckets import as_buckets


def derived_buffer_names(model: nn.Module) -> frozenset[str]:
    """The model's non-persistent buffers by ``named_buffers()`` name (``persistent=False``: not in its
    ``state_dict``, so never in a checkpoint). vLLM computes them itself from the config, and its loader
    rejects them (Qwen2's ``rotary_emb.inv_freq``: "There is no module or parameter named 'rotary_emb'")."""
    out = set()
    for prefix, mod in model.named_modules():
        for name in getattr(mod, "_non_persistent_buffers_set", ()):
            if mod._buffers.get(name) is not None:
                out.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(out)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Floating tensors travel in the rollout dtype (vLLM's model dtype); others unchanged."""
    return dtype if t.is_floating_point() else t.dtype


def chunk_runs(sizes: list[int], buffer_bytes: int) -> list[range]:
    """How vLLM's packed transfer cuts a stream of tensors (byte sizes) into chunks: tensors are added to
    the current chunk until its size exceeds ``buffer_bytes``, then the chunk is closed (so a chunk may
    exceed the buffer by its last tensor). Sender and receiver must agree, so this mirrors
    ``packed_tensor.pack_tensors`` / ``packed_nccl_broadcast_consumer`` exactly (checked against the
    source in tests/trainer/rollout/test_vllm_api.py)."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > buffer_bytes:
            runs.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


@dataclass
class FlatChunk:
    """One flat chunk in vLLM's packed layout: tensor i is bytes [offsets[i], offsets[i] + sizes[i])."""

    flat: torch.Tensor  # uint8 [sum(sizes)]
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sizes: list[int]

    @property
    def offsets(self) -> list[int]:
        out, off = [], 0
        for n in self.sizes:
            out.append(off)
            off += n
        return out

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views of ``flat`` (a copy only for a tensor whose offset its dtype cannot view)."""
        out = []
        for name, dt, shape, off, n in zip(self.names, self.dtype_names, self.shapes, self.offsets, self.sizes,
                                           strict=True):
            dtype = getattr(torch, dt)
            part = self.flat[off : off + n]
            if part.storage_offset() % dtype.itemsize:
                part = part.clone()
            out.append((name, part.view(dtype).view(shape)))
        return out


def pack_flat(pairs: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
              out: torch.Tensor | None = None, device: torch.device | None = None) -> FlatChunk:
    """Copy (and cast to ``wire_dtype``) the tensors back to back into one uint8 tensor: vLLM's packed
    layout. ``out``: a reusable uint8 buffer of at least the chunk's size (the prefix is used); else a new
    tensor on ``device`` (default: the first tensor's)."""
    names, dts, shapes, sizes = [], [], [], []
    for name, t in pairs:
        dt = wire_dtype(t, dtype)
        names.append(name)
        dts.append(dt)
        shapes.append(list(t.shape))
        sizes.append(t.numel() * dt.itemsize)
    total = sum(sizes)
    if out is None:
        dev = device if device is not None else (pairs[0][1].device if pairs else "cpu")
        flat = torch.empty(total, dtype=torch.uint8, device=dev)
    else:
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
            raise ValueError(f"pack_flat: out must be a 1-D uint8 tensor of >= {total} bytes")
        flat = out[:total]
    off = 0
    for (_, t), dt, n in zip(pairs, dts, sizes, strict=True):
        dst = flat[off : off + n]
        if n and (dst.storage_offset() % dt.itemsize == 0):
            dst.view(dt).copy_(t.reshape(-1))  # cast and copy in one pass
        elif n:  # unaligned (a wider tensor after an odd-sized one): copy the bytes
            dst.copy_(t.detach().to(dt).reshape(-1).view(torch.uint8))
        off += n
    return FlatChunk(flat, names, [dtype_name(d) for d in dts], shapes, sizes)


def iter_chunks(buckets: Iterable, dtype: torch.dtype, buffer_bytes: int,
                out: Callable[[int], torch.Tensor | None] | None = None,
                device: torch.device | None = None, skip: Collection[str] = ()) -> Iterator[FlatChunk]:
    """The weight update (Buckets or (name, tensor) pairs) as flat chunks, one bucket at a time, each
    bucket cut by ``chunk_runs`` (a bucket fits one chunk when its wire size is within ``buffer_bytes``).
    A bucket's tensors are copied before the next bucket is asked for (ZeRO-3 releases it then).
    ``out(nbytes)``: a reusable buffer for a chunk, or None for a fresh one.

    Only floating tensors travel: they all share the wire dtype, so every tensor's offset in a chunk is a
    multiple of its itemsize, which vLLM's receiver needs (it views each byte range as the dtype in place).
    Integer buffers (step counters, masks) are not weights vLLM loads; nor are the names in ``skip``
    (``derived_buffer_names``). A bucket left empty sends nothing."""
    for bucket in as_buckets(buckets):
        pairs = [(n, t) for n, t in bucket if t.is_floating_point() and n not in skip]
        sizes = [t.numel() * wire_dtype(t, dtype).itemsize for _, t in pairs]
        for run in chunk_runs(sizes, buffer_bytes):
            buf = out(sum(sizes[i] for i in run)) if out is not None else None
            yield pack_flat([pairs[i] for i in run], dtype, out=buf, device=device)


def request_outputs_to_batch(outputs, eos_token_ids: Iterable[int]) -> RolloutBatch:
    """``LLM.generate`` results (one ``RequestOutput`` per prompt, ``n=1``, ``logprobs=0``) -> RolloutBatch.

    Reads ``out.outputs[0].token_ids`` (ints) and ``out.outputs[0].logprobs`` (per position a mapping
    token id -> ``Logprob`` with ``.logprob``; a list of dicts or vLLM's ``FlatLogprobs``; the sampled token
    is always a key).
    """
    ids, lps = [], []
    for k, out in enumerate(outputs):
        comp = out.outputs[0]
        toks = [int(t) for t in comp.token_ids]
        if comp.logprobs is None:
            raise RuntimeError(f"vLLM returned no log-probs for request {k} (SamplingParams(logprobs=0) ignored?)")
        row = []
        for pos, (tok, d) in enumerate(zip(toks, comp.logprobs, strict=False)):  # a short row: refused below
            if tok not in d:
                raise RuntimeError(f"vLLM log-probs of request {k} lack the sampled token {tok} at position {pos}")
            row.append(float(d[tok].logprob))
        if len(row) != len(toks):
            raise RuntimeError(f"vLLM returned {len(row)} log-probs for the {len(toks)} tokens of request {k}")
        ids.append(toks)
        lps.append(row)
    return finish_rollouts(ids, lps, eos_token_ids)


def _token_id(tok) -> int:
    if isinstance(tok, int):
        return tok
    if isinstance(tok, str) and tok.startswith("token_id:"):
        return int(tok[len("token_id:"):])
    raise RuntimeError(f"vLLM server returned token {tok!r}; expected 'token_id:N' (return_tokens_as_token_ids)")


def completion_to_batch(response: dict, n_prompts: int, eos_token_ids: Iterable[int]) -> RolloutBatch:
    """A ``/v1/completions`` response for ``n_prompts`` token-id prompts (n=1, logprobs=0,
    return_tokens_as_token_ids) -> RolloutBatch in prompt order (choices sorted by ``index``)."""
    choices = sorted(response.get("choices", []), key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(n_prompts)):
        raise RuntimeError(f"vLLM server answered choices {[c['index'] for c in choices]} "
                           f"for {n_prompts} prompts")
    ids, lps = [], []
    for c in choices:
        lp = c.get("logprobs") or {}
        if "tokens" not in lp or "token_logprobs" not in lp:
            raise RuntimeError(f"vLLM server returned no log-probs for choice {c['index']}")
        ids.append([_token_id(t) for t in lp["tokens"]])
        lps.append([float(x) for x in lp["token_logprobs"]])
    return finish_rollouts(ids, lps, eos_token_ids)


def completion_payload(model: str, prompts: list[list[int]], sampling: SamplingParams,
                       eos_token_ids: list[int]) -> dict:
    """The ``/v1/completions`` request body (fields of vLLM's ``CompletionRequest``). Every sampling knob
    is explicit so a model's generation_config (top_k, repetition_penalty, ...) cannot change the rollout
    distribution."""
    return {"model": model, "prompt": prompts, "n": 1, "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "logprobs": 0, "stop_token_ids": list(eos_token_ids), "ignore_eos": False,
            "skip_special_tokens": False, "return_tokens_as_token_ids": True, "stream": False}


def sampling_kwargs(sampling: SamplingParams, eos_token_ids: list[int], seed: int | None) -> dict:
    """``vllm.SamplingParams(**kwargs)`` for one colocated request (fields checked against vLLM's source)."""
    return dict(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0, min_p=0.0,
                repetition_penalty=1.0, max_tokens=sampling.max_new_tokens, logprobs=0,
                stop_token_ids=list(eos_token_ids), ignore_eos=False, detokenize=False, seed=seed)


def split_group_requests(counts: list[int], rows: list) -> list[list]:
    """Cut the concatenated results of a TP group's requests back into per-rank lists (``counts[r]``
    items for rank r, in rank order)."""
    if sum(counts) != len(rows):
        raise ValueError(f"split_group_requests: {sum(counts)} requests but {len(rows)} results")
    out, a = [], 0
    for c in counts:
        out.append(rows[a : a + c])
        a += c
    return out
