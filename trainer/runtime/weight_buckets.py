"""Bucketed weight sync: policy -> rollout engine, a bounded group of whole tensors at a time.

    for bucket in iter_buckets(model.named_parameters(), bucket_bytes=64 << 20, gather=zero3_gather):
        engine.load(bucket)        # bucket.names, bucket.tensors (full tensors, valid until the next bucket)
                                   # bucket.meta() / bucket.flatten() for a transfer as one flat uint8 tensor

A *bucket* is a run of consecutive tensors (model order) whose full sizes, each rounded up to
``ALIGN`` bytes, sum to at most ``bucket_bytes``; a tensor larger than that goes alone; ``bucket_bytes``
<= 0 gives one tensor per bucket (the per-parameter sync). Under ZeRO-3 the producer gathers exactly the
parameters of one bucket (``gather(params)``, e.g. ``deepspeed.zero.GatheredParameters``) while the
consumer holds it and releases them before gathering the next: host/GPU memory beyond the model's own
shards is one bucket of gathered parameters (plus one flat buffer of the same size when the consumer
flattens), never a full state dict. Every rank of a ZeRO-3 group must iterate to the end (the gathers
are collectives); ranks that do not send simply drain the iterator.

Names pass through unchanged by default: they are the Hugging Face model's ``named_parameters()`` /
``named_buffers()`` names, which both the built-in HF engine and vLLM's ``model.load_weights`` take
(vLLM fuses Qwen2's q/k/v and gate/up projections itself while loading). ``rename`` is the hook for a
model whose rollout copy is named differently: it maps a name to the target's name, or to None to skip
the tensor.

The flat wire layout (``BucketMeta``): tensor i occupies bytes ``[offsets[i], offsets[i] + nbytes_i)``
of a 1-D uint8 tensor of ``meta.nbytes`` bytes (``nbytes_i`` = numel x itemsize of ``dtypes[i]``,
offsets ``ALIGN``-aligned), in row-major order with shape ``shapes[i]``. ``unflatten`` is the inverse;
the vLLM server-side receiver uses it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes; every tensor's offset in a flat bucket is a multiple (covers every dtype's itemsize)
MB = 1 << 20


def bucket_bytes_from_mb(mb: float) -> int:
    """Bucket capacity in bytes for a size in MiB (``rollout.sync_bucket_mb``); <= 0 means per tensor."""
    if not math.isfinite(mb):
        raise ValueError(f"sync_bucket_mb: must be finite, got {mb}")
    return int(mb * MB) if mb > 0 else 0


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"bucket meta: unknown dtype {name!r}")
    return dt


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The full (gathered) shape of a tensor: ``ds_shape`` for a ZeRO-3 partitioned parameter."""
    return tuple(getattr(t, "ds_shape", t.shape))


def full_nbytes(t: torch.Tensor) -> int:
    return math.prod(full_shape(t)) * t.element_size()


def plan_buckets(nbytes: list[int], bucket_bytes: int) -> list[range]:
    """Split tensors of the given sizes (bytes, model order) into consecutive runs.

    Each run's aligned sizes sum to <= ``bucket_bytes``, except a run of one tensor larger than that;
    ``bucket_bytes`` <= 0: one tensor per run. Greedy: a run is closed when the next tensor would not fit.
    """
    runs: list[range] = []
    start, used = 0, 0
    for i, n in enumerate(nbytes):
        size = aligned(n)
        if i > start and (bucket_bytes <= 0 or used + size > bucket_bytes):
            runs.append(range(start, i))
            start, used = i, 0
        used += size
    if start < len(nbytes):
        runs.append(range(start, len(nbytes)))
    return runs


@dataclass(frozen=True)
class BucketMeta:
    """What a receiver needs to cut a flat bucket back into named tensors (JSON-serialisable)."""

    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]  # torch dtype names without the "torch." prefix, e.g. "bfloat16"
    offsets: list[int]  # byte offsets into the flat uint8 tensor, multiples of ALIGN
    nbytes: int  # size of the flat tensor in bytes

    def to_json(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "dtypes": list(self.dtypes), "offsets": list(self.offsets), "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: dict) -> BucketMeta:
        try:
            meta = cls([str(n) for n in d["names"]], [[int(x) for x in s] for s in d["shapes"]],
                       [str(t) for t in d["dtypes"]], [int(o) for o in d["offsets"]], int(d["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bucket meta: malformed ({type(exc).__name__}: {exc})") from None
        if not (len(meta.names) == len(meta.shapes) == len(meta.dtypes) == len(meta.offsets)):
            raise ValueError("bucket meta: names, shapes, dtypes and offsets differ in length")
        return meta


class Bucket:
    """A group of whole named tensors (full, i.e. gathered under ZeRO-3; any dtype and device).

    ``tensors[i]`` may alias the policy's parameters: valid and unmodified only until the producer is
    asked for the next bucket. Iterating a bucket gives ``(name, tensor)`` pairs.
    """

    def __init__(self, names: list[str], tensors: list[torch.Tensor]):
        if len(names) != len(tensors):
            raise ValueError("Bucket: names and tensors differ in length")
        self.names = names
        self.tensors = tensors

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(zip(self.names, self.tensors, strict=True))

    def __len__(self) -> int:
        return len(self.names)

    @property
    def nbytes(self) -> int:
        """Bytes of the flat form (tensor sizes rounded up to ALIGN)."""
        return sum(aligned(t.numel() * t.element_size()) for t in self.tensors)

    def meta(self) -> BucketMeta:
        offsets, off = [], 0
        for t in self.tensors:
            offsets.append(off)
            off += aligned(t.numel() * t.element_size())
        return BucketMeta(list(self.names), [list(t.shape) for t in self.tensors],
                          [_dtype_name(t.dtype) for t in self.tensors], offsets, off)

    def flatten(self, out: torch.Tensor | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """The bucket as one uint8 tensor [meta().nbytes] (layout: module docstring).

        ``out``: a uint8 buffer of at least that many bytes to write into (reused across buckets to
        keep one buffer alive); returns the prefix of ``out`` that was written. Otherwise a new tensor
        on ``device`` (default: the first tensor's device). Padding bytes are zero.
        """
        meta = self.meta()
        if out is None:
            dev = device if device is not None else (self.tensors[0].device if self.tensors else "cpu")
            flat = torch.zeros(meta.nbytes, dtype=torch.uint8, device=dev)
        else:
            if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < meta.nbytes:
                raise ValueError(f"Bucket.flatten: out must be a 1-D uint8 tensor of >= {meta.nbytes} bytes")
            flat = out[: meta.nbytes]
        for t, off in zip(self.tensors, meta.offsets, strict=True):
            n = t.numel() * t.element_size()
            flat[off : off + n].view(t.dtype).copy_(t.reshape(-1))
        return flat


def unflatten(flat: torch.Tensor, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` (uint8 [>= meta.nbytes]) as the named tensors of ``meta`` (no copies)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < meta.nbytes:
        raise ValueError(f"unflatten: need a 1-D uint8 tensor of >= {meta.nbytes} bytes, "
                         f"got {flat.dtype} {tuple(flat.shape)}")
    out = []
    for name, shape, dt, off in zip(meta.names, meta.shapes, meta.dtypes, meta.offsets, strict=True):
        dtype = dtype_from_name(dt)
        n = math.prod(shape) * dtype.itemsize
        if off % ALIGN or off + n > meta.nbytes:
            raise ValueError(f"unflatten: {name!r} at offset {off} ({n} bytes) is outside the bucket")
        out.append((name, flat[off : off + n].view(dtype).view(shape)))
    return out


Gather = Callable[[list[torch.Tensor]], contextlib.AbstractContextManager]


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 gather: Gather | None = None,
                 rename: Callable[[str], str | None] | None = None) -> Iterator[Bucket]:
    """Yield Buckets of the named tensors (parameters and buffers, model order).

    ``named``: (name, tensor) pairs, e.g. ``model.named_parameters()``; held by reference, never copied.
    ``gather(params)``: a context manager that makes the full data of the given ZeRO-3 parameters
    (those with a ``ds_id``) available in ``p.data`` for its duration; None when nothing is
    partitioned. ``rename``: name -> target name, or None to skip the tensor (module docstring).
    """
    entries = []
    for name, t in named:
        target = rename(name) if rename is not None else name
        if target is not None:
            entries.append((target, t))
    for run in plan_buckets([full_nbytes(t) for _, t in entries], bucket_bytes):
        group = [entries[i] for i in run]
        partitioned = [t for _, t in group if hasattr(t, "ds_id")]
        ctx = gather(partitioned) if (gather is not None and partitioned) else contextlib.nullcontext()
        with ctx:
            tensors = []
            for name, t in group:
                data = t.data if isinstance(t, torch.nn.Parameter) else t
                if tuple(data.shape) != full_shape(t):
                    raise RuntimeError(f"weight sync: {name!r} has shape {tuple(data.shape)} inside the "
                                       f"gather, expected {full_shape(t)} (not gathered?)")
                tensors.append(data.detach())
            yield Bucket([n for n, _ in group], tensors)


def iter_named(items: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten a weight update to (name, tensor) pairs: ``items`` yields Buckets or (name, tensor)."""
    for item in items:
        if isinstance(item, Bucket):
            yield from item
        else:
            name, tensor = item
            yield name, tensor


def drain(items: Iterable) -> None:
    """Walk a weight update to its end without keeping anything: a rank that copies nothing must still
    take part in a ZeRO-3 producer's gathers, which are collectives."""
    for _ in items:
        pass


def as_buckets(items: Iterable) -> Iterator[Bucket]:
    """A weight update as Buckets: Buckets pass through, each (name, tensor) pair becomes a one-tensor
    bucket (a per-tensor producer may release a tensor once the next is asked for, so pairs are never
    grouped here: group at the producer, ``iter_buckets``)."""
    for item in items:
        if isinstance(item, Bucket):
            yield item
        else:
            name, tensor = item
            yield Bucket([name], [tensor])


def counted(buckets: Iterable[Bucket], sent: list[int]) -> Iterator[Bucket]:
    """``buckets`` passed on one by one, their tensors' bytes added to ``sent[0]`` as they go."""
    for bucket in buckets:
        sent[0] += sum(t.numel() * t.element_size() for t in bucket.tensors)
        yield bucket
