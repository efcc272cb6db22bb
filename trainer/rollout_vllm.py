"""vLLM rollout engines behind the ``RolloutEngine`` interface (``rollout.engine: vllm``).

Supported vLLM: ``>=0.8.5,<0.12`` (the ``vllm`` extra of pyproject). ``vllm`` is imported only when an
engine is built; a missing one raises ImportError, one outside the range RuntimeError, both naming the
installed version and the range. Nothing here has run against a real vLLM (none can be installed where
fastcov is developed): the vLLM calls follow vLLM's public API and examples for that range; the parts
without vLLM (output conversion, bucket protocol, request splitting) are tested with fakes.

colocated (``rollout.vllm_mode: colocated``): every training rank hosts one vLLM worker on its own GPU
    (``LLM(distributed_executor_backend="external_launcher", enable_sleep_mode=True)`` in-process with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``t = rollout.vllm_tensor_parallel_size`` consecutive ranks
    form one tensor-parallel engine (t = GPUs per node: one engine per node). Generation gathers the
    group's prompts, every rank of the group runs the same ``LLM.generate`` (SPMD) and keeps its own
    slice. ``LLM.sleep(level=1)`` after generating frees the KV cache and moves the weights to host
    memory for training; ``LLM.wake_up`` (``tags=["weights"]`` then ``["kv_cache"]`` where supported)
    before loading weights / generating. Weights are loaded bucket by bucket with
    ``LLM.collective_rpc(fn)``, ``fn(worker)`` calling ``worker.model_runner.model.load_weights(weights=)``
    (vLLM shards each full tensor for its TP rank and fuses Qwen2's q/k/v and gate/up itself), then
    ``LLM.reset_prefix_cache()``.
server (``rollout.vllm_mode: server``): vLLM servers on their own GPUs, started with
    ``python -m fastcov.trainer.rollout_vllm serve --model MODEL --tensor-parallel-size t ...`` (vLLM's
    OpenAI server plus this module's weight-sync routes and worker extension). Each training rank sends
    its prompts as token ids to ``POST /v1/completions`` (``logprobs: 0``, ``return_tokens_as_token_ids``),
    split evenly over the servers. Weight sync (trainer rank 0 only; other ranks drain the bucket
    iterator, then all meet at a barrier):
        1. ``POST /fastcov/weight_sync/init {host, port, world_size, rank_offset}`` to every server, then
           rank 0 joins ``StatelessProcessGroup.create(host, port, rank=0, world_size)`` +
           ``PyNcclCommunicator`` (world = 1 + servers x t; server i's TP rank j is 1 + i*t + j);
        2. per bucket: ``POST /fastcov/weight_sync/bucket`` with ``BucketMeta`` JSON (names, shapes,
           dtypes, byte offsets, nbytes) to every server, concurrently ``broadcast(flat uint8, src=0)``;
           each worker receives into a buffer, ``unflatten``s it and calls ``load_weights``; the HTTP
           reply is the server's acknowledgement;
        3. ``POST /fastcov/weight_sync/done`` (reset the prefix cache).

Log-probs: vLLM >= 0.10.2 is asked for ``logprobs_mode="processed_logprobs"`` (after temperature and
top-p, i.e. renormalised over the nucleus when top_p < 1); older V1 engines return the raw
(temperature-1) log-prob of the sampled token. The trainer recomputes old log-probs with the policy, so
these only feed the ``rollout_logprob_diff`` diagnostic. Names pass through unchanged (weight_sync).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fastcov.trainer.rollout import (RolloutBatch, RolloutEngine, SamplingParams, finish_rollouts,
                                     split_evenly)
from fastcov.trainer.weight_sync import Bucket, BucketMeta, as_buckets, unflatten

SUPPORTED = ">=0.8.5,<0.12"
_MIN, _BELOW = (0, 8, 5), (0, 12)
_PROCESSED_LOGPROBS_FROM = (0, 10, 2)


# ----------------------------------------------------------------------------------------- import / version

def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.10.1.post1"`` -> (0, 10, 1); ``"0.12.0rc1"`` -> (0, 12, 0) (pre-releases count as their release)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if not m:
        raise RuntimeError(f"vLLM: cannot parse the installed version {version!r} (supported: vllm{SUPPORTED})")
    return tuple(int(x) for x in m.group(1).split("."))


def check_vllm_version(version: str) -> tuple[int, ...]:
    rel = release_tuple(version)
    if not (_MIN <= rel and rel[:2] < _BELOW):
        raise RuntimeError(f"rollout.engine=vllm: vLLM {version} is installed, fastcov supports vllm{SUPPORTED} "
                           f"(pip install 'fastcov[vllm]')")
    return rel


def import_vllm():
    """The ``vllm`` module, checked against the supported range."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"rollout.engine=vllm needs vLLM{SUPPORTED}, which is not installed "
                          f"(pip install 'fastcov[vllm]'): {exc}") from exc
    check_vllm_version(getattr(vllm, "__version__", "unknown"))
    return vllm


# ----------------------------------------------------------------------------------------- output conversion

def request_outputs_to_batch(outputs, eos_token_ids: Iterable[int]) -> RolloutBatch:
    """``LLM.generate`` results (one ``RequestOutput`` per prompt, ``n=1``, ``logprobs=0``) -> RolloutBatch.

    Reads ``out.outputs[0].token_ids`` (ints) and ``out.outputs[0].logprobs`` (per position a dict
    token id -> ``Logprob`` with ``.logprob``; the sampled token is always a key).
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
    """The ``/v1/completions`` request body. Every sampling knob is explicit so a model's
    generation_config (top_k, repetition_penalty, ...) cannot change the rollout distribution."""
    return {"model": model, "prompt": prompts, "n": 1, "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "logprobs": 0, "stop_token_ids": list(eos_token_ids), "ignore_eos": False,
            "skip_special_tokens": False, "return_tokens_as_token_ids": True, "stream": False}


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
        raise RuntimeError(f"vLLM server {url}: HTTP {exc.code}: {body}") from None
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

def _nccl_communicator(host: str, port: int, world_size: int, device: torch.device):
    """Trainer rank 0's end of the weight-sync group (vLLM's StatelessProcessGroup + PyNcclCommunicator)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size)
    return PyNcclCommunicator(pg, device=device)


class ServerWeightSender:
    """Rank 0's side of the weight-update protocol (module docstring) for ``len(urls)`` servers of
    ``tp`` workers each. ``post(url, payload)`` and ``make_communicator(host, port, world, device)`` are
    injectable (tests use fakes); the communicator needs ``broadcast(tensor, src=0)``."""

    def __init__(self, urls: list[str], tp: int, device: torch.device,
                 post: Callable[[str, dict], dict] = post_json,
                 make_communicator: Callable = _nccl_communicator, host: str | None = None):
        self.urls = [u.rstrip("/") for u in urls]
        self.tp = int(tp)
        self.device = device
        self.post = post
        self.make_communicator = make_communicator
        self.host = host
        self.comm = None
        self._buf: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))

    @property
    def world_size(self) -> int:
        return 1 + len(self.urls) * self.tp

    def _all(self, path: str, payloads: list[dict]) -> list:
        return [self._pool.submit(self.post, u + path, p) for u, p in zip(self.urls, payloads)]

    def connect(self) -> None:
        from fastcov.trainer.engine import free_port

        host = self.host or routable_ip(self.urls[0])
        port = free_port()
        futs = self._all("/fastcov/weight_sync/init", [
            {"host": host, "port": port, "world_size": self.world_size, "rank_offset": 1 + i * self.tp}
            for i in range(len(self.urls))])
        self.comm = self.make_communicator(host, port, self.world_size, self.device)
        for f in futs:
            f.result()

    def send(self, bucket: Bucket) -> BucketMeta:
        if self.comm is None:
            self.connect()
        meta = bucket.meta()
        if self._buf is None or self._buf.numel() < meta.nbytes:
            self._buf = None  # free the old buffer before allocating the larger one
            self._buf = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        flat = bucket.flatten(out=self._buf)
        futs = self._all("/fastcov/weight_sync/bucket", [meta.to_json()] * len(self.urls))
        self.comm.broadcast(flat, src=0)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for f in futs:
            f.result()
        return meta

    def finish(self) -> None:
        for f in self._all("/fastcov/weight_sync/done", [{}] * len(self.urls)):
            f.result()

    def close(self) -> None:
        if self.comm is not None:
            for f in self._all("/fastcov/weight_sync/close", [{}] * len(self.urls)):
                f.result()
            self.comm = None
        self._buf = None
        self._pool.shutdown(wait=False)


class VLLMServerEngine(RolloutEngine):
    """Rollouts from vLLM servers over HTTP; weight sync over NCCL from trainer rank 0."""

    def __init__(self, urls: list[str], eos_token_ids: list[int], tp: int, device: torch.device,
                 rank: int = 0, world: int = 1, post: Callable[[str, dict], dict] = post_json,
                 sender: ServerWeightSender | None = None):
        if not urls:
            raise ValueError("rollout.vllm_server_urls: no server given")
        self.urls = [u.rstrip("/") for u in urls]
        self.eos = list(eos_token_ids)
        self.rank, self.world = rank, world
        self._device = device
        self.post = post
        self.sender = sender if sender is not None else (
            ServerWeightSender(self.urls, tp, device, post=post) if rank == 0 else None)
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
            for bucket in as_buckets(named_tensors):
                self.sender.send(bucket)
            self.sender.finish()
        else:
            for _ in named_tensors:  # ZeRO-3 gathers are collectives: take part, send nothing
                pass
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and self.world > 1:
            dist.barrier()  # nobody generates before rank 0's last bucket has landed

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self._pool.shutdown(wait=False)


# ----------------------------------------------------------------------------------------- colocated mode

def _load_weights_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (``LLM.collective_rpc``): full HF-named tensors -> its TP shard."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMColocatedEngine(RolloutEngine):
    """One in-process vLLM worker per training rank; ``tp`` consecutive ranks form one engine."""

    def __init__(self, llm, vllm_module, eos_token_ids: list[int], device: torch.device, tp: int = 1,
                 group=None, sleep_level: int = 1):
        self.llm = llm
        self.vllm = vllm_module
        self.eos = list(eos_token_ids)
        self._device = device
        self.tp = tp
        self.group = group  # torch.distributed group of this engine's tp ranks (None when tp == 1)
        self.sleep_level = sleep_level
        self.asleep: set[str] = set()
        self._tagged_wake = "tags" in inspect.signature(llm.wake_up).parameters

    @property
    def device(self) -> torch.device:
        return self._device

    def _wake(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self.asleep]
        if not todo:
            return
        if self._tagged_wake:
            self.llm.wake_up(tags=todo)
            self.asleep -= set(todo)
        else:
            self.llm.wake_up()
            self.asleep.clear()

    def _sleep(self) -> None:
        self.llm.sleep(level=self.sleep_level)
        self.asleep = {"weights", "kv_cache"}

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
        self._wake(["weights", "kv_cache"])
        try:
            params = [self.vllm.SamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=-1,
                max_tokens=sampling.max_new_tokens, logprobs=0, stop_token_ids=self.eos,
                detokenize=False, seed=s) for _, s in reqs]
            outs = (self.llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
                    if reqs else [])
        finally:
            self._sleep()
        batch = request_outputs_to_batch(outs, self.eos)
        ids = split_group_requests(counts, batch.token_ids)[me]
        lps = split_group_requests(counts, batch.logprobs)[me]
        return RolloutBatch(ids, lps)

    def update_weights(self, named_tensors: Iterable) -> None:
        self._wake(["weights"])
        for bucket in as_buckets(named_tensors):
            self.llm.collective_rpc(_load_weights_on_worker, args=(list(bucket),))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        self.llm = None


# ----------------------------------------------------------------------------------------- factory

def make_vllm_engine(cfg, model, tokenizer, *, device: torch.device, rank: int = 0,
                     world: int = 1) -> RolloutEngine:
    """The vLLM engine for ``cfg.rollout`` (see ``make_rollout_engine``)."""
    vllm = import_vllm()
    r = cfg.rollout
    eos = [tokenizer.eos_token_id]
    t = r.vllm_tensor_parallel_size
    if r.vllm_mode == "server":
        return VLLMServerEngine(r.vllm_server_urls, eos, t, device, rank=rank, world=world)
    if device.type != "cuda":
        raise ValueError("rollout.vllm_mode: colocated vLLM needs CUDA training ranks (trainer.device)")
    if world % t:
        raise ValueError(f"rollout.vllm_tensor_parallel_size: {t} does not divide the {world} training ranks")
    group = None
    if t > 1:
        import torch.distributed as dist

        group, _ = dist.new_subgroups(group_size=t)  # ranks [k*t, (k+1)*t): vLLM's TP groups
    # vLLM builds its model from a config directory; the weights arrive with the first update_weights.
    model_dir = Path(cfg.trainer.run_dir) / "vllm" / f"rank{rank}"
    model_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(model_dir)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
    max_new = max(r.max_new_tokens, cfg.trainer.eval_max_new_tokens or 0)
    kwargs = dict(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                  dtype="float32" if cfg.model.dtype == "fp32" else "bfloat16",
                  tensor_parallel_size=t, distributed_executor_backend="external_launcher",
                  gpu_memory_utilization=r.vllm_gpu_memory_utilization, enable_sleep_mode=True,
                  enable_prefix_caching=True, seed=cfg.trainer.seed,
                  max_model_len=cfg.data.max_prompt_len + max_new)
    if release_tuple(vllm.__version__) >= _PROCESSED_LOGPROBS_FROM:
        kwargs["logprobs_mode"] = "processed_logprobs"
    llm = vllm.LLM(**kwargs)
    return VLLMColocatedEngine(llm, vllm, eos, device, tp=t, group=group)


# ----------------------------------------------------------------------------------------- server side

class WeightSyncWorkerExtension:
    """Mixed into each vLLM GPU worker of a server (``--worker-extension-cls``): the receiving end."""

    def fastcov_init_weight_sync(self, host: str, port: int, world_size: int, rank_offset: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup.create(host=host, port=port, rank=rank_offset + self.rank,
                                          world_size=world_size)
        self._fastcov_comm = PyNcclCommunicator(pg, device=self.device)

    def fastcov_receive_bucket(self, meta_json: dict) -> None:
        meta = BucketMeta.from_json(meta_json)
        flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        self._fastcov_comm.broadcast(flat, src=0)
        torch.cuda.current_stream().synchronize()
        self.model_runner.model.load_weights(weights=unflatten(flat, meta))

    def fastcov_close_weight_sync(self) -> None:
        self._fastcov_comm = None


def add_weight_sync_routes(router) -> None:
    """The HTTP side of the protocol on vLLM's OpenAI server (FastAPI ``router``)."""
    from fastapi import Request

    def client(raw: Request):
        return raw.app.state.engine_client

    @router.post("/fastcov/weight_sync/init")
    async def _init(raw: Request):
        b = await raw.json()
        await client(raw).collective_rpc("fastcov_init_weight_sync",
                                         args=(b["host"], int(b["port"]), int(b["world_size"]),
                                               int(b["rank_offset"])))
        return {"ok": True}

    @router.post("/fastcov/weight_sync/bucket")
    async def _bucket(raw: Request):
        await client(raw).collective_rpc("fastcov_receive_bucket", args=(await raw.json(),))
        return {"ok": True}

    @router.post("/fastcov/weight_sync/done")
    async def _done(raw: Request):
        await client(raw).reset_prefix_cache()
        return {"ok": True}

    @router.post("/fastcov/weight_sync/close")
    async def _close(raw: Request):
        await client(raw).collective_rpc("fastcov_close_weight_sync")
        return {"ok": True}


def serve(argv: list[str]) -> None:
    """``python -m fastcov.trainer.rollout_vllm serve --model MODEL [vLLM OpenAI server options]``."""
    import uvloop

    vllm = import_vllm()
    from vllm.entrypoints.openai import api_server

    try:
        from vllm.utils import FlexibleArgumentParser
    except ImportError:  # moved in later releases
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    args = api_server.make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.worker_extension_cls = "fastcov.trainer.rollout_vllm.WeightSyncWorkerExtension"
    if release_tuple(vllm.__version__) >= _PROCESSED_LOGPROBS_FROM and hasattr(args, "logprobs_mode"):
        args.logprobs_mode = "processed_logprobs"
    add_weight_sync_routes(api_server.router)
    uvloop.run(api_server.run_server(args))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        sys.exit("usage: python -m fastcov.trainer.rollout_vllm serve --model MODEL [vLLM OpenAI server options]")
    serve(sys.argv[2:])
