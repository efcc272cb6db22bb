"""vLLM rollout engines behind the ``RolloutEngine`` interface (``rollout.engine: vllm``).

Supported vLLM: ``>=0.26,<0.34`` (the ``vllm`` extra of pyproject). ``vllm`` is imported only when an engine
is built; a missing one raises ImportError, one outside the range RuntimeError, both naming the installed
version and the range. Every vLLM name used here is checked against the source of vLLM 0.26.0 and 0.33.0 by
tests/test_vllm_api.py (``make test-vllm-api``); where the two differ, ``VLLMApi`` (the one version adapter)
says which form to use. docs/vllm.md has setup, modes and memory.

Weights go through vLLM's own RL weight-transfer API (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``): vLLM's worker owns the update
lifecycle (layerwise reload: each layer is re-processed once all of its tensors have arrived). fastcov only
decides what a chunk is: one ``weight_sync`` bucket (a bounded run of whole tensors, gathered together under
ZeRO-3), cast to the rollout dtype (bf16) and laid out as one flat tensor in vLLM's packed layout
(``pack_flat``: the tensors' bytes back to back, the layout of vLLM's ``packed_tensor.pack_tensors``).

colocated (``rollout.vllm_mode: colocated``): every training rank hosts one in-process vLLM worker on its own
    GPU (``LLM(distributed_executor_backend="external_launcher", enable_sleep_mode=True, load_format="dummy")``
    with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``t = rollout.vllm_tensor_parallel_size`` consecutive ranks
    form one tensor-parallel engine. The trainer's tensors reach the worker in the same process, so the
    transport is the weight-transfer backend ``fastcov_local`` that this module registers with vLLM's
    ``WeightTransferEngineFactory``: its update info carries the (name, tensor) views of one flat bf16
    bucket, and it loads them with the model's ``load_weights`` inside vLLM's layerwise reload (what vLLM's
    own NCCL and IPC backends do). vLLM's ``ipc`` backend cannot serve here: a CUDA IPC handle is opened by
    another process, never by the one that made it, and vLLM 0.26 imports ``ray`` for it.
    Sleep mode: after each ``generate`` the engine sleeps at level 2 (weights and KV cache discarded, nothing
    copied to the host) when the weights can be pushed again from the policy (ZeRO 0-2: the engine keeps a
    reference to the trainer's model, whose parameters DeepSpeed updates in place), else at level 1 (weights
    offloaded to host memory; ZeRO-3, where a push needs the whole group's gathers). ``update_weights`` wakes
    the weights, pushes, and leaves the KV cache asleep; ``generate`` wakes the KV cache (and, after a level-2
    sleep with no push since, pushes the policy's current weights first).
server (``rollout.vllm_mode: server``): ``vllm serve`` on its own GPUs, started by
    ``python -m fastcov.trainer.rollout_vllm serve --model MODEL [vllm serve options]``, which runs vLLM's own
    CLI with ``--weight-transfer-config '{"backend": "nccl"}'``, ``--logprobs-mode raw_logprobs`` and
    ``VLLM_SERVER_DEV_MODE=1`` (vLLM serves its weight-update routes only in that mode). Nothing of vLLM's
    server is copied or patched. Rollouts: each rank posts its prompts as token ids to ``/v1/completions``,
    split evenly over the servers. Weight sync (trainer rank 0; the other ranks drain the buckets, then all
    meet at a barrier): once, ``/init_weight_transfer_engine`` on every server while rank 0 joins the NCCL
    group with vLLM's ``nccl_common.trainer_init`` (world = 1 + servers x t; server i's workers are ranks
    1 + i*t ...); per sync ``/start_weight_update``, per bucket ``/update_weights`` (names, dtypes, shapes)
    concurrently with one NCCL broadcast of the flat bf16 bucket (vLLM's packed mode), then
    ``/finish_weight_update`` and ``/reset_prefix_cache``.

Log-probs: ``logprobs_mode="raw_logprobs"`` (both modes): vLLM's log-softmax of the raw logits, before
temperature, penalties and top-k/top-p; the engine returns the sampled token's value unchanged. At
temperature 1 (the paper's recipe) that is the policy's own log-prob; at another temperature it is the
temperature-1 value (docs/vllm.md). Names pass through unchanged (weight_sync).
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from fastcov.trainer.rollout import RolloutBatch, RolloutEngine, SamplingParams, finish_rollouts, split_evenly
from fastcov.trainer.runtime.weight_buckets import as_buckets, bucket_bytes_from_mb, drain, iter_buckets

SUPPORTED = ">=0.26,<0.34"
_MIN, _BELOW = (0, 26), (0, 34)
TESTED_VERSIONS = ("0.26.0", "0.33.0")  # the sources tests/test_vllm_api.py parses
LOGPROBS_MODE = "raw_logprobs"
LOCAL_BACKEND = "fastcov_local"  # the in-process weight-transfer backend registered by register_local_backend
SERVER_BACKEND = "nccl"
# vLLM's weight-update routes (served with VLLM_SERVER_DEV_MODE=1), in the order of one sync
ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
          "/reset_prefix_cache")


# ----------------------------------------------------------------------------------------- import / version

def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.26.1.post1"`` -> (0, 26, 1); ``"0.34.0rc1"`` -> (0, 34, 0) (pre-releases count as their release)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if not m:
        raise RuntimeError(f"vLLM: cannot parse the installed version {version!r}; fastcov supports "
                           f"vllm{SUPPORTED} (0.26 to 0.33)")
    return tuple(int(x) for x in m.group(1).split("."))


def check_vllm_version(version: str) -> tuple[int, ...]:
    rel = release_tuple(version)
    if not (_MIN <= rel[:2] < _BELOW):
        raise RuntimeError(f"rollout.engine=vllm: vLLM {version} is installed, fastcov supports vllm{SUPPORTED} "
                           f"(0.26 to 0.33; pip install 'fastcov[vllm]')")
    return rel


def import_vllm():
    """The ``vllm`` module, checked against the supported range."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"rollout.engine=vllm needs vLLM{SUPPORTED} (0.26 to 0.33), which is not installed "
                          f"(pip install 'fastcov[vllm]'): {exc}") from exc
    check_vllm_version(getattr(vllm, "__version__", "unknown"))
    return vllm


class VLLMApi:
    """The one place where supported vLLM versions differ for this module.

    NCCL packed transfer: up to 0.27 the packed flag and buffer geometry travel with every
    ``update_weights`` (``NCCLWeightTransferUpdateInfo``); from 0.28 they are fixed once by
    ``init_weight_transfer_engine`` (``NCCLWeightTransferInitInfo``) and the update info carries only
    names, dtypes and shapes. Everything else this module calls is the same in 0.26 and 0.33.
    """

    PACKED_AT_INIT_FROM = (0, 28)
    NUM_BUFFERS = 1  # one receive buffer: a chunk is one bucket, loaded before the next arrives

    def __init__(self, version: str):
        self.version = str(version)
        self.release = release_tuple(version)

    @property
    def packed_at_init(self) -> bool:
        return self.release[:2] >= self.PACKED_AT_INIT_FROM

    def _packed(self, buffer_bytes: int) -> dict:
        return {"packed": True, "packed_buffer_size_bytes": int(buffer_bytes),
                "packed_num_buffers": self.NUM_BUFFERS}

    def nccl_init_info(self, *, host: str, port: int, world_size: int, rank_offset: int,
                       buffer_bytes: int) -> dict:
        """``init_info`` of ``/init_weight_transfer_engine`` for one server's workers."""
        info = {"master_address": host, "master_port": int(port), "rank_offset": int(rank_offset),
                "world_size": int(world_size)}
        if self.packed_at_init:
            info.update(self._packed(buffer_bytes))
        return info

    def nccl_update_info(self, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                         buffer_bytes: int) -> dict:
        """``update_info`` of ``/update_weights`` for one bucket."""
        info = {"names": list(names), "dtype_names": list(dtype_names), "shapes": [list(s) for s in shapes]}
        if not self.packed_at_init:
            info.update(self._packed(buffer_bytes))
        return info


# ----------------------------------------------------------------------------------------- flat buckets

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Floating tensors travel in the rollout dtype (vLLM's model dtype); others unchanged."""
    return dtype if t.is_floating_point() else t.dtype


def chunk_runs(sizes: list[int], buffer_bytes: int) -> list[range]:
    """How vLLM's packed transfer cuts a stream of tensors (byte sizes) into chunks: tensors are added to
    the current chunk until its size exceeds ``buffer_bytes``, then the chunk is closed (so a chunk may
    exceed the buffer by its last tensor). Sender and receiver must agree, so this mirrors
    ``packed_tensor.pack_tensors`` / ``packed_nccl_broadcast_consumer`` exactly (checked against the
    source in tests/test_vllm_api.py)."""
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
        for name, dt, shape, off, n in zip(self.names, self.dtype_names, self.shapes, self.offsets, self.sizes):
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
    for (_, t), dt, n in zip(pairs, dts, sizes):
        dst = flat[off : off + n]
        if n and (dst.storage_offset() % dt.itemsize == 0):
            dst.view(dt).copy_(t.reshape(-1))  # cast and copy in one pass
        elif n:  # unaligned (a wider tensor after an odd-sized one): copy the bytes
            dst.copy_(t.detach().to(dt).reshape(-1).view(torch.uint8))
        off += n
    return FlatChunk(flat, names, [_dtype_name(d) for d in dts], shapes, sizes)


def iter_chunks(buckets: Iterable, dtype: torch.dtype, buffer_bytes: int,
                out: Callable[[int], torch.Tensor | None] | None = None,
                device: torch.device | None = None) -> Iterator[FlatChunk]:
    """The weight update (Buckets or (name, tensor) pairs) as flat chunks, one bucket at a time, each
    bucket cut by ``chunk_runs`` (a bucket fits one chunk when its wire size is within ``buffer_bytes``).
    A bucket's tensors are copied before the next bucket is asked for (ZeRO-3 releases it then).
    ``out(nbytes)``: a reusable buffer for a chunk, or None for a fresh one.

    Only floating tensors travel: they all share the wire dtype, so every tensor's offset in a chunk is a
    multiple of its itemsize, which vLLM's receiver needs (it views each byte range as the dtype in place).
    Integer buffers (step counters, masks) are not weights vLLM loads."""
    for bucket in as_buckets(buckets):
        pairs = [(n, t) for n, t in bucket if t.is_floating_point()]
        sizes = [t.numel() * wire_dtype(t, dtype).itemsize for _, t in pairs]
        for run in chunk_runs(sizes, buffer_bytes):
            buf = out(sum(sizes[i] for i in run)) if out is not None else None
            yield pack_flat([pairs[i] for i in run], dtype, out=buf, device=device)


# ----------------------------------------------------------------------------------------- output conversion

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
        for pos, (tok, d) in enumerate(zip(toks, comp.logprobs)):
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


# ----------------------------------------------------------------------------------------- HTTP

def post_json(url: str, payload: dict | None = None, timeout: float = 3600.0) -> dict:
    """POST (or GET when ``payload`` is None) JSON; raises RuntimeError naming the URL on any failure."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode() or "{}")
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:500]
        hint = (" (vLLM serves its weight-update routes only with VLLM_SERVER_DEV_MODE=1: start the server "
                "with `python -m fastcov.trainer.rollout_vllm serve`)") if exc.code == 404 else ""
        raise RuntimeError(f"vLLM server {url}: HTTP {exc.code}: {body}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RuntimeError(f"vLLM server {url}: {type(exc).__name__}: {exc}") from None


def routable_ip(url: str) -> str:
    """This machine's address on the route to ``url``'s host (what a server uses to reach rank 0)."""
    host = urllib.request.urlparse(url).hostname or "127.0.0.1"
    port = urllib.request.urlparse(url).port or 80
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))  # UDP: no packet is sent
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# ----------------------------------------------------------------------------------------- server mode

def _nccl_trainer_init(init_info: dict):
    """Trainer rank 0's end of the weight-transfer NCCL group: vLLM's own helper (rank 0, current device)."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(init_info)


class ServerWeightSender:
    """Rank 0's side of vLLM's NCCL weight transfer to ``len(urls)`` servers of ``tp`` workers each.

    ``post(url, payload)`` and ``make_communicator(init_info_dict)`` are injectable (tests use fakes); the
    communicator needs ``broadcast(tensor, src=0, stream=None)`` (vLLM's ``PyNcclCommunicator``).
    """

    def __init__(self, urls: list[str], tp: int, device: torch.device, api: VLLMApi,
                 dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 64 << 20,
                 post: Callable[[str, dict], dict] = post_json,
                 make_communicator: Callable = _nccl_trainer_init, host: str | None = None):
        self.urls = [u.rstrip("/") for u in urls]
        self.tp = int(tp)
        self.device = device
        self.api = api
        self.dtype = dtype
        # vLLM closes a chunk once it exceeds the buffer, so a bucket of <= bucket_bytes is one chunk
        self.buffer_bytes = max(int(bucket_bytes), 1)
        self.post = post
        self.make_communicator = make_communicator
        self.host = host
        self.comm = None
        self._buf: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))
        self.stats: dict[str, float] = {}

    @property
    def world_size(self) -> int:
        return 1 + len(self.urls) * self.tp

    def _all(self, path: str, payloads: list[dict | None] | None = None) -> list:
        payloads = payloads if payloads is not None else [{}] * len(self.urls)
        return [self._pool.submit(self.post, u + path, p) for u, p in zip(self.urls, payloads)]

    @staticmethod
    def _wait(futs) -> None:
        for f in futs:
            f.result()

    def connect(self) -> None:
        from fastcov.trainer.engine import free_port

        host = self.host or routable_ip(self.urls[0])
        port = free_port()
        futs = self._all("/init_weight_transfer_engine", [
            {"init_info": self.api.nccl_init_info(host=host, port=port, world_size=self.world_size,
                                                  rank_offset=1 + i * self.tp, buffer_bytes=self.buffer_bytes)}
            for i in range(len(self.urls))])
        # the servers' workers and rank 0 meet in the same rendezvous: post first, then join
        self.comm = self.make_communicator({"master_address": host, "master_port": port,
                                            "world_size": self.world_size})
        self._wait(futs)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # free the old buffer before allocating the larger one
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf

    def sync(self, items: Iterable) -> int:
        """One full weight update; returns the bytes broadcast."""
        t0 = time.perf_counter()
        if self.comm is None:
            self.connect()
        self._wait(self._all("/start_weight_update"))
        sent = 0
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for chunk in iter_chunks(items, self.dtype, self.buffer_bytes, out=self._buffer):
            info = self.api.nccl_update_info(chunk.names, chunk.dtype_names, chunk.shapes, self.buffer_bytes)
            futs = self._all("/update_weights", [{"update_info": info}] * len(self.urls))
            self.comm.broadcast(chunk.flat, src=0, stream=stream)
            if stream is not None:
                stream.synchronize()  # the buffer is reused by the next chunk
            self._wait(futs)
            sent += chunk.flat.numel()
        self._wait(self._all("/finish_weight_update"))
        self._wait(self._all("/reset_prefix_cache"))
        self.stats = {"sync_s": time.perf_counter() - t0, "sync_bytes": float(sent)}
        return sent

    def close(self) -> None:
        self.comm = None
        self._buf = None
        self._pool.shutdown(wait=False)


class VLLMServerEngine(RolloutEngine):
    """Rollouts from ``vllm serve`` servers over HTTP; weight sync over NCCL from trainer rank 0."""

    def __init__(self, urls: list[str], eos_token_ids: list[int], tp: int, device: torch.device,
                 rank: int = 0, world: int = 1, post: Callable[[str, dict], dict] = post_json,
                 sender: ServerWeightSender | None = None, api: VLLMApi | None = None,
                 dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 64 << 20):
        if not urls:
            raise ValueError("rollout.vllm_server_urls: no server given")
        self.urls = [u.rstrip("/") for u in urls]
        self.eos = list(eos_token_ids)
        self.rank, self.world = rank, world
        self._device = device
        self.post = post
        if sender is None and rank == 0:
            if api is None:
                raise ValueError("VLLMServerEngine: rank 0 needs the vLLM version adapter (api=VLLMApi(...))")
            sender = ServerWeightSender(self.urls, tp, device, api, dtype=dtype, bucket_bytes=bucket_bytes,
                                        post=post)
        self.sender = sender
        self._model: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls))

    @property
    def device(self) -> torch.device:
        return self._device

    def served_model(self) -> str:
        if self._model is None:
            models = self.post(self.urls[0] + "/v1/models", None).get("data") or []
            if not models:
                raise RuntimeError(f"vLLM server {self.urls[0]}: /v1/models lists no model")
            self._model = models[0]["id"]
        return self._model

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        """Prompts split evenly over the servers, one request each; ``generator`` is not used (a
        request-level seed would give the n copies of a prompt the same response)."""
        if not prompts:
            return RolloutBatch([], [])
        model = self.served_model()
        jobs = []
        for url, sl in zip(self.urls, split_evenly(len(prompts), len(self.urls))):
            part = [list(map(int, p)) for p in prompts[sl]]
            if part:
                payload = completion_payload(model, part, sampling, self.eos)
                jobs.append((len(part), self._pool.submit(self.post, url + "/v1/completions", payload)))
        ids, lps = [], []
        for n, fut in jobs:
            b = completion_to_batch(fut.result(), n, self.eos)
            ids += b.token_ids
            lps += b.logprobs
        return RolloutBatch(ids, lps)

    def update_weights(self, named_tensors: Iterable) -> None:
        if self.sender is not None:
            self.sender.sync(named_tensors)
        else:
            drain(named_tensors)  # ZeRO-3 gathers are collectives: take part, send nothing
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and self.world > 1:
            dist.barrier()  # nobody generates before rank 0's last bucket has landed

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self._pool.shutdown(wait=False)


# ----------------------------------------------------------------------------------------- colocated mode

@dataclass
class LocalInitInfo:
    """``init_info`` of the ``fastcov_local`` backend: nothing to set up (same process)."""


@dataclass
class LocalUpdateInfo:
    """``update_info`` of the ``fastcov_local`` backend: the chunk's (name, tensor) pairs themselves,
    passed by reference (vLLM's in-process executor calls the worker directly)."""

    weights: list = field(default_factory=list)


_LOCAL_ENGINE_CLS = None


def local_transfer_engine_cls():
    """The ``fastcov_local`` weight-transfer backend: a subclass of vLLM's ``WeightTransferEngine``
    (built on first use: its base class is vLLM's)."""
    global _LOCAL_ENGINE_CLS
    if _LOCAL_ENGINE_CLS is not None:
        return _LOCAL_ENGINE_CLS
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    class FastcovLocalWeightTransferEngine(WeightTransferEngine):
        """Loads tensors handed over in-process into the worker's model, inside vLLM's layerwise reload
        (the lifecycle vLLM's NCCL and IPC backends use)."""

        init_info_cls = LocalInitInfo
        update_info_cls = LocalUpdateInfo

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info) -> None:
            self.model.load_weights(update_info.weights)

        def shutdown(self) -> None:
            pass

        @staticmethod
        def trainer_send_weights(iterator, trainer_args) -> None:  # abstract in vLLM 0.26; unused here
            raise NotImplementedError("fastcov_local: the trainer calls LLM.update_weights in-process")

    _LOCAL_ENGINE_CLS = FastcovLocalWeightTransferEngine
    return _LOCAL_ENGINE_CLS


def register_local_backend() -> None:
    """Register ``fastcov_local`` with vLLM's ``WeightTransferEngineFactory`` (once per process; the
    colocated worker runs in this process, so it sees the registration)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(LOCAL_BACKEND, local_transfer_engine_cls())
    except ValueError:  # already registered in this process
        pass


class VLLMColocatedEngine(RolloutEngine):
    """One in-process vLLM worker per training rank; ``tp`` consecutive ranks form one engine.

    ``refresh()``: the policy's current weights as an update (Buckets), or None when they cannot be read
    without the other ranks (ZeRO-3); with it the engine sleeps at level 2, without it at level 1.
    """

    def __init__(self, llm, vllm_module, eos_token_ids: list[int], device: torch.device, tp: int = 1,
                 group=None, dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 64 << 20,
                 refresh: Callable[[], Iterable] | None = None):
        self.llm = llm
        self.vllm = vllm_module
        self.eos = list(eos_token_ids)
        self._device = device
        self.tp = tp
        self.group = group  # torch.distributed group of this engine's tp ranks (None when tp == 1)
        self.dtype = dtype
        self.buffer_bytes = max(int(bucket_bytes), 1)
        self.refresh = refresh
        self.sleep_level = 2 if refresh is not None else 1
        self.asleep: set[str] = set()
        self.weights_valid = False  # dummy weights until the first update
        self._transfer_ready = False
        self.stats: dict[str, float] = {"refreshes": 0}
        self._sleep(level=2)  # dummy weights: free the GPU for the trainer until the first push

    @property
    def device(self) -> torch.device:
        return self._device

    def _wake(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self.asleep]
        if todo:
            t0 = time.perf_counter()
            self.llm.wake_up(tags=todo)
            self.asleep -= set(todo)
            self.stats["wake_s"] = time.perf_counter() - t0

    def _sleep(self, level: int | None = None) -> None:
        level = self.sleep_level if level is None else level
        t0 = time.perf_counter()
        self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        if level >= 2:
            self.weights_valid = False
        self.stats["sleep_s"] = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        n = len(prompts)
        seeds = ([None] * n if generator is None else
                 torch.randint(0, 2**31 - 1, (n,), generator=generator, device=generator.device).tolist())
        reqs = [(list(map(int, p)), s) for p, s in zip(prompts, seeds)]
        counts, me = [n], 0
        if self.group is not None:  # SPMD: every rank of the engine runs the same requests
            import torch.distributed as dist

            parts = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(parts, reqs, group=self.group)
            counts, me = [len(p) for p in parts], dist.get_rank(self.group)
            reqs = [r for p in parts for r in p]
        if not reqs:  # nothing for the whole engine: leave it asleep
            return RolloutBatch([], [])
        if not self.weights_valid:
            if self.refresh is None:
                raise RuntimeError("colocated vLLM: no weights loaded (call update_weights first)")
            self.update_weights(self.refresh())  # after a level-2 sleep: the policy's weights again
            self.stats["refreshes"] += 1
        self._wake(["weights", "kv_cache"])
        t0 = time.perf_counter()
        try:
            params = [self.vllm.SamplingParams(**sampling_kwargs(sampling, self.eos, s)) for _, s in reqs]
            outs = self.llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
        finally:
            self.stats["generate_s"] = time.perf_counter() - t0
            self._sleep()
        batch = request_outputs_to_batch(outs, self.eos)
        ids = split_group_requests(counts, batch.token_ids)[me]
        lps = split_group_requests(counts, batch.logprobs)[me]
        return RolloutBatch(ids, lps)

    def update_weights(self, named_tensors: Iterable) -> None:
        """Every bucket as one flat chunk in the rollout dtype (a fresh buffer each: vLLM's layerwise
        reload may keep a layer's tensors until the layer's last one arrives) through vLLM's RL API."""
        t0 = time.perf_counter()
        self._wake(["weights"])
        if not self._transfer_ready:
            self.llm.init_weight_transfer_engine({"init_info": {}})
            self._transfer_ready = True
        self.llm.start_weight_update()
        nbytes = 0
        for chunk in iter_chunks(named_tensors, self.dtype, self.buffer_bytes, device=self._device):
            self.llm.update_weights({"update_info": {"weights": chunk.views()}})
            nbytes += chunk.flat.numel()
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()
        self.weights_valid = True
        self.stats.update(sync_s=time.perf_counter() - t0, sync_bytes=float(nbytes))

    def close(self) -> None:
        self.llm = None


# ----------------------------------------------------------------------------------------- factory

def rollout_dtype(cfg) -> torch.dtype:
    return torch.float32 if cfg.model.dtype == "fp32" else torch.bfloat16


def colocated_llm_kwargs(cfg, model_dir: str) -> dict:
    """``vllm.LLM(**kwargs)`` of the colocated engine (every key checked against vLLM's source)."""
    r = cfg.rollout
    max_new = max(r.max_new_tokens, cfg.trainer.eval_max_new_tokens or 0)
    return dict(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                dtype=_dtype_name(rollout_dtype(cfg)), tensor_parallel_size=r.vllm_tensor_parallel_size,
                distributed_executor_backend="external_launcher",
                gpu_memory_utilization=r.vllm_gpu_memory_utilization, enable_sleep_mode=True,
                enable_prefix_caching=True, seed=cfg.trainer.seed,
                max_model_len=cfg.data.max_prompt_len + max_new, logprobs_mode=LOGPROBS_MODE,
                weight_transfer_config={"backend": LOCAL_BACKEND})


def make_vllm_engine(cfg, model, tokenizer, *, device: torch.device, rank: int = 0,
                     world: int = 1) -> RolloutEngine:
    """The vLLM engine for ``cfg.rollout`` (see ``make_rollout_engine``)."""
    vllm = import_vllm()
    api = VLLMApi(vllm.__version__)
    r = cfg.rollout
    eos = [tokenizer.eos_token_id]
    t = r.vllm_tensor_parallel_size
    bucket_bytes = bucket_bytes_from_mb(r.sync_bucket_mb)
    if r.vllm_mode == "server":
        return VLLMServerEngine(r.vllm_server_urls, eos, t, device, rank=rank, world=world, api=api,
                                dtype=rollout_dtype(cfg), bucket_bytes=bucket_bytes)
    if device.type != "cuda":
        raise ValueError("rollout.vllm_mode: colocated vLLM needs CUDA training ranks (trainer.device)")
    if world % t:
        raise ValueError(f"rollout.vllm_tensor_parallel_size: {t} does not divide the {world} training ranks")
    group = None
    if t > 1:
        import torch.distributed as dist

        group, _ = dist.new_subgroups(group_size=t)  # ranks [k*t, (k+1)*t): vLLM's TP groups
    # vLLM builds its model from a config directory; the weights arrive with the first update_weights.
    from pathlib import Path

    model_dir = Path(cfg.trainer.run_dir) / "vllm" / f"rank{rank}"
    model_dir.mkdir(parents=True, exist_ok=True)
    hf_config = copy.deepcopy(model.config)  # vLLM picks its model class from `architectures`
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [type(model).__name__]
    hf_config.save_pretrained(model_dir)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine (and worker) in this process
    register_local_backend()
    llm = vllm.LLM(**colocated_llm_kwargs(cfg, str(model_dir)))
    refresh = None
    if cfg.trainer.zero_stage < 3:  # the policy's full parameters are readable on this rank alone
        named = list(model.named_parameters()) + list(model.named_buffers())

        def refresh():
            return iter_buckets(named, bucket_bytes)

    return VLLMColocatedEngine(llm, vllm, eos, device, tp=t, group=group, dtype=rollout_dtype(cfg),
                               bucket_bytes=bucket_bytes, refresh=refresh)


# ----------------------------------------------------------------------------------------- server start

def serve_command(argv: list[str], python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The command and extra environment that run ``vllm serve`` (vLLM's own CLI entry point) for
    fastcov: NCCL weight transfer, raw log-probs, and the weight-update routes (VLLM_SERVER_DEV_MODE=1).
    Options already in ``argv`` win."""
    argv = list(argv)
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra = []
    if "--weight-transfer-config" not in given:
        extra += ["--weight-transfer-config", json.dumps({"backend": SERVER_BACKEND})]
    if "--logprobs-mode" not in given:
        extra += ["--logprobs-mode", LOGPROBS_MODE]
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", *argv, *extra]
    return cmd, {"VLLM_SERVER_DEV_MODE": "1"}


def serve(argv: list[str]) -> None:
    """``python -m fastcov.trainer.rollout_vllm serve --model MODEL [vllm serve options]``."""
    import_vllm()
    cmd, env = serve_command(argv)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


def _main(args: list[str]) -> int:
    if not args or args[0] != "serve":
        print("usage: python -m fastcov.trainer.rollout_vllm serve MODEL|--model MODEL [vllm serve options]",
              file=sys.stderr)
        return 2
    serve(args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
