"""An engine that generates beside the trainer (``rollout.async``): ``AsyncEngine`` wraps an engine in its own
process (the HF engine, engine_process.py) or a vLLM server, and ``make_async_engine`` builds it.

    engine = make_async_engine(cfg, policy_lm, tokenizer, device=..., rank=..., world=..., run_dir=...)
    future = engine.generate_async(prompts, sampling)   # a background thread asks the engine
    ...                                                  # the trainer trains meanwhile
    engine.update_weights(buckets, version=step)         # between two generations: the engine waits only for this
    generated = future.result()                          # Generated(out, version, start, end)

One request reaches the engine at a time: a generation in flight finishes before a push starts, and a push
waiting for the engine goes before the next generation (``_acquire``), so the engine stops generating for the
push alone. ``version`` is the step whose weights the engine holds (0: the starting weights); every generation
reports the version it ran with. Shared engines (vLLM servers, which every rank uses) push only once every rank's
generations are done (a barrier on the main thread).

Restarts (``rollout.engine_restarts``): an engine process that died is started again on the main thread and filled
with the policy's current weights (``full_weights``, set by the run), then the failed request runs again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from fastcov.trainer.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from fastcov.trainer.rollout.engine_process import EngineDied, EngineProcess, WorkerSpec
from fastcov.trainer.runtime.distributed import barrier
from fastcov.trainer.runtime.weight_buckets import drain

logger = logging.getLogger(__name__)
Span = Callable[[str, str, float, float], None]  # (lane, phase, start, end), perf_counter seconds


@dataclass
class Generated:
    out: RolloutBatch
    version: int  # the step whose weights drew it
    start: float  # perf_counter at the request and at its reply
    end: float


class AsyncEngine(RolloutEngine):
    """``engine`` behind a lock and a background thread (module docstring). ``shared``: every rank talks to the
    same engine (vLLM servers), so a push waits for all ranks. ``restarts``: how many times a dead engine process
    may be started again. ``on_span(lane, phase, start, end)``: where the engine's busy spans go (a timeline)."""

    def __init__(self, engine: RolloutEngine, device: torch.device, *, shared: bool = False, restarts: int = 0,
                 on_span: Span | None = None):
        self.engine = engine
        self.device = device
        self.shared = shared
        self.restarts_left = int(restarts)
        self.on_span = on_span
        self.version = 0
        self.full_weights: Callable[[], Iterable] | None = None  # the policy's whole weights, for a restart
        self.restarted = False  # a restart happened since the run last looked (LoRA: send everything again)
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._pushes_waiting = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastcov-rollout")

    @property
    def last_stats(self) -> dict:
        return getattr(self.engine, "last_stats", {})

    # ------------------------------------------------------------------------------------------ the lock

    def _acquire(self, push: bool) -> None:
        with self._cv:
            if self._closed and not push:
                raise EngineDied("the rollout engine is closed")
            if push:
                self._pushes_waiting += 1
            while self._busy or (not push and self._pushes_waiting):
                self._cv.wait()
            if push:
                self._pushes_waiting -= 1
            self._busy = True

    def _release(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()

    def _span(self, phase: str, start: float, end: float) -> None:
        if self.on_span is not None:
            self.on_span("engine", phase, start, end)

    # ------------------------------------------------------------------------------------------ generation

    def run_generation(self, prompts: list[list[int]], sampling: SamplingParams) -> Generated:
        """One blocking generation under the lock, on the calling thread; engine errors propagate."""
        self._acquire(push=False)
        try:
            version, start = self.version, time.perf_counter()
            out = self.engine.generate(prompts, sampling)
            end = time.perf_counter()
        finally:
            self._release()
        self._span("generate", start, end)
        return Generated(out, version, start, end)

    def generate_async(self, prompts: list[list[int]], sampling: SamplingParams) -> Future:
        """``run_generation`` in the background thread; the future's result is a ``Generated``."""
        return self._pool.submit(self.run_generation, prompts, sampling)

    def result(self, future: Future, prompts: list[list[int]], sampling: SamplingParams,
               trainer_version: int) -> Generated:
        """The future's ``Generated``; if the engine process died meanwhile and a restart is allowed, restarts it
        with the policy's weights now (``trainer_version``; main thread) and generates again."""
        try:
            return future.result()
        except EngineDied as exc:
            self.recover(exc, trainer_version)
            return self.run_generation(prompts, sampling)

    def generate_now(self, prompts: list[list[int]], sampling: SamplingParams, trainer_version: int) -> Generated:
        """``run_generation`` on the calling thread, with ``result``'s restart."""
        try:
            return self.run_generation(prompts, sampling)
        except EngineDied as exc:
            self.recover(exc, trainer_version)
            return self.run_generation(prompts, sampling)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        """Blocking, with the engine's weights (evaluation, right after a push: the policy's own)."""
        return self.generate_now(prompts, sampling, self.version).out

    # ------------------------------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable, version: int | None = None) -> None:
        """Push between two generations (a generation in flight finishes first); the engine holds ``version``
        after it (the run's step). An engine process that dies during the push is restarted when allowed."""
        died = None
        self._acquire(push=True)
        try:
            if self.shared:
                barrier()  # every rank's generations are done before rank 0 changes the shared engine's weights
            start = time.perf_counter()
            try:
                self.engine.update_weights(named_tensors)
                if version is not None:
                    self.version = int(version)
            except EngineDied as exc:
                died = exc
            self._span("push", start, time.perf_counter())
        finally:
            self._release()
        if died is not None:
            drain(named_tensors)  # what is left of this push (restarts need ZeRO 0-2: no collective in it)
            self.recover(died, self.version if version is None else version)

    def recover(self, exc: EngineDied, version: int) -> None:
        """Restart a dead engine process with the policy's current weights (``version``: the step they are
        from), or raise ``exc`` when no restart is left. Main thread only."""
        if self.restarts_left <= 0 or not isinstance(self.engine, EngineProcess) or self.full_weights is None:
            raise exc
        self.restarts_left -= 1
        logger.warning(f"{exc}; restarting it ({self.restarts_left} restart(s) left)")
        self._acquire(push=True)
        try:
            self.engine.start()
            self.engine.update_weights(self.full_weights())
            self.version = int(version)
            self.restarted = True
        finally:
            self._release()

    def close(self) -> None:
        """No new generation starts; one in flight in an engine process ends with the process (its result is
        not wanted), one on a server is waited for; then the engine closes. Calling it again does nothing."""
        with self._cv:
            self._closed, busy = True, self._busy
        if busy and isinstance(self.engine, EngineProcess):
            self.engine.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._acquire(push=True)
        try:
            self.engine.close()
        finally:
            self._release()


# ---------------------------------------------------------------------------------------------- factory


def worker_spec(cfg, model, tokenizer, device: torch.device, rank: int, model_dir: Path) -> WorkerSpec:
    """The engine process's spec for the policy ``model`` (its HF config is written to ``model_dir``)."""
    from fastcov.trainer.runtime.lora import has_adapters, lora_info

    model_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(model_dir)
    dtype = next(model.parameters()).dtype
    lora = None
    if has_adapters(model):
        info = lora_info(model)
        lora = {"lora_rank": info["rank"], "lora_alpha": info["alpha"], "lora_dropout": info["dropout"],
                "lora_targets": list(info["targets"])}
    timeout = cfg.trainer.collective_timeout_s or 86400.0
    return WorkerSpec(model_dir=str(model_dir), dtype=str(dtype).removeprefix("torch."), device=str(device),
                      attn_implementation=model.config._attn_implementation,
                      eos_token_ids=[int(tokenizer.eos_token_id)], pad_token_id=int(tokenizer.pad_token_id),
                      batch_size=cfg.rollout.batch_size, token_budget=cfg.rollout.token_budget,
                      threads=cfg.trainer.threads if device.type == "cpu" else 0, lora=lora, rank=rank,
                      timeout_s=float(timeout))


def make_async_engine(cfg, model, tokenizer, *, device: torch.device, rank: int, world: int,
                      run_dir: Path, on_span: Span | None = None) -> AsyncEngine:
    """The engine of an asynchronous run: the HF engine in a process of its own per rank (``rollout.engine: hf``)
    or the vLLM servers (``rollout.vllm_mode: server``). ``model``: the policy's HF causal LM as DeepSpeed holds it
    (its config and dtype; under ZeRO-3 its parameters are partitioned, which the copy does not need)."""
    r = cfg.rollout
    if r.engine == "hf":
        spec = worker_spec(cfg, model, tokenizer, device, rank, Path(run_dir) / "engine" / f"rank{rank}")
        engine: RolloutEngine = EngineProcess(spec, Path(run_dir) / "engine" / f"rank{rank}.log", device)
        return AsyncEngine(engine, device, restarts=r.engine_restarts, on_span=on_span)
    from fastcov.trainer.rollout.base import make_rollout_engine

    engine = make_rollout_engine(cfg, model, tokenizer, device=device, rank=rank, world=world,
                                 zero_stage=cfg.trainer.zero_stage)
    return AsyncEngine(engine, device, shared=True, on_span=on_span)
