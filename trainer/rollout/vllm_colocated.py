"""Colocated vLLM (``rollout.vllm_mode: colocated``): every training rank hosts one in-process vLLM worker
(``LLM(distributed_executor_backend="external_launcher", load_format="dummy")`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``t = rollout.vllm_tensor_parallel_size`` consecutive ranks form one
tensor-parallel engine.

The trainer's tensors reach the worker in the same process, so the transport is the weight-transfer backend
``fastcov_local`` that this module registers with vLLM's ``WeightTransferEngineFactory``: its update info
carries the (name, tensor) views of one flat bucket, and it loads them with the model's ``load_weights``
inside vLLM's layerwise reload (what vLLM's own NCCL and IPC backends do). vLLM's ``ipc`` backend cannot
serve here: a CUDA IPC handle is opened by another process, never by the one that made it, and vLLM 0.26
imports ``ray`` for it.

Sleep mode (CUDA only; ``sleep=False`` elsewhere, e.g. vLLM's CPU platform): after each ``generate`` the
engine sleeps at level 2 (weights and KV cache discarded, nothing copied to the host) when the weights can be
pushed again from the policy (ZeRO 0-2: the engine keeps a reference to the trainer's model, whose
parameters DeepSpeed updates in place), else at level 1 (weights offloaded to host memory; ZeRO-3, where a
push needs the whole group's gathers). ``update_weights`` wakes the weights, pushes, and leaves the KV cache
asleep; ``generate`` wakes the KV cache (and, after a level-2 sleep with no push since, pushes the policy's
current weights first).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fastcov.trainer.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from fastcov.trainer.rollout.vllm_api import LOCAL_BACKEND
from fastcov.trainer.rollout.vllm_plugin import reprocess_tied_layers
from fastcov.trainer.rollout.vllm_wire import (
    iter_chunks,
    request_outputs_to_batch,
    sampling_kwargs,
    split_group_requests,
)


@dataclass
class LocalInitInfo:
    """``init_info`` of the ``fastcov_local`` backend: nothing to set up (same process)."""


@dataclass
class LocalUpdateInfo:
    """``update_info`` of the ``fastcov_local`` backend: the chunk's (name, tensor) pairs themselves,
    passed by reference (vLLM's in-process executor calls the worker directly)."""

    weights: list = field(default_factory=list)


_LOCAL_ENGINE_CLS = None


def local_transfer_engine_cls() -> type:
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
            reprocess_tied_layers(self.model)  # a tied LM head's processed weight (vllm_plugin.py)

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
    ``sleep``: False where vLLM has no sleep mode (its CPU platform): the engine stays awake, weights and
    KV cache resident. ``skip``: names never sent (``vllm_wire.derived_buffer_names``).
    """

    def __init__(self, llm, vllm_module, eos_token_ids: list[int], device: torch.device, tp: int = 1,
                 group=None, dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 64 << 20,
                 refresh: Callable[[], Iterable] | None = None, sleep: bool = True,
                 skip: Collection[str] = (), lora=None):
        self.llm = llm
        self.vllm = vllm_module
        self.eos = list(eos_token_ids)
        self._device = device
        self.tp = tp
        self.group = group  # torch.distributed group of this engine's tp ranks (None when tp == 1)
        self.dtype = dtype
        self.buffer_bytes = max(int(bucket_bytes), 1)
        self.refresh = refresh
        self.sleep_level = 0 if not sleep else 2 if refresh is not None else 1
        self.skip = frozenset(skip)
        # LoRA (runtime.lora.AdapterSync): base weights by load_weights, the adapters as a LoRARequest
        self.lora = lora
        self.lora_request = None
        self.asleep: set[str] = set()
        self.weights_valid = False  # dummy weights until the first update
        self._transfer_ready = False
        self.stats: dict[str, float] = {"refreshes": 0}
        if sleep:
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
        if level == 0:  # no sleep mode: stay awake
            return
        t0 = time.perf_counter()
        self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        if level >= 2:
            self.weights_valid = False
        self.stats["sleep_s"] = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        n = len(prompts)
        seeds = (list(sampling.seeds) if sampling.seeds is not None  # rollout.seeding per_sample
                 else [None] * n if generator is None else
                 torch.randint(0, 2**31 - 1, (n,), generator=generator, device=generator.device).tolist())
        reqs = [(list(map(int, p)), s) for p, s in zip(prompts, seeds, strict=True)]
        counts, me = [n], 0
        if self.group is not None:  # SPMD: every rank of the engine runs the same requests
            parts: list[Any] = [None] * dist.get_world_size(self.group)
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
            outs = self.llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False,
                                     **({"lora_request": self.lora_request} if self.lora_request else {}))
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
        if self.lora is not None:  # adapters set aside, base names plain (after the first sync: no base)
            named_tensors = self.lora.base_weights(named_tensors)
        else:
            self.llm.start_weight_update()
        nbytes, started = 0, self.lora is None
        for chunk in iter_chunks(named_tensors, self.dtype, self.buffer_bytes, device=self._device,
                                 skip=self.skip):
            if not started:
                self.llm.start_weight_update()
                started = True
            self.llm.update_weights({"update_info": {"weights": chunk.views()}})
            nbytes += chunk.flat.numel()
        if started:
            self.llm.finish_weight_update()
        written = self.lora.write() if self.lora is not None else None
        if written is not None:  # one adapter directory per sync, a new id so vLLM loads it afresh
            request_cls = importlib.import_module("vllm.lora.request").LoRARequest
            self.lora_request = request_cls(f"policy-{self.lora.version}", self.lora.version, str(written[0]))
            nbytes += written[1]
        self.llm.reset_prefix_cache()
        self.weights_valid = True
        self.stats.update(sync_s=time.perf_counter() - t0, sync_bytes=float(nbytes))

    def close(self) -> None:
        """End the vLLM engine: its executor and its own process groups (vLLM's teardown also destroys the default
        group, so this runs at exit, through ``runtime.distributed.before_shutdown``, not between two runs of one
        process). Without it vLLM's finalizer runs after fastcov destroyed the groups and prints a traceback."""
        llm, self.llm = self.llm, None
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if client is not None:
            client.shutdown()


