"""Where an asynchronous run's batches come from (``rollout.async``), and how old they are.

The loop asks a source for each generation batch of a step (``draw(step, n)``: n = 1 for the step's batch,
n > 1 for DAPO's refills) and tells it when the step's rollouts are collected (``collected(step)``); the run asks
it whether a push is due after a step (``push_due``), lets it finish what must finish with the old weights first
(``before_push``), and keeps what a resume needs: each rank's own in the checkpoint (``save`` / ``load``), the rest
in the trainer state (``state`` / ``load_state``, ``sampler_state``).

Versions. The engine holds version v = the step whose weights it has (0: the run's starting weights). The policy
that trains step t is version t − 1, so a batch drawn by version v is ``lag = t − 1 − v`` versions stale there.

* ``OneStepSource`` (``rollout.async: one_step``): batch t + 1 is launched when step t's rollouts are collected,
  with the weights after step t − 1, and runs while step t trains; at the end of step t it finishes, then the
  weights after step t are pushed. DAPO's refills of step t are generated there and then, by version t − 1. The
  schedule depends on nothing but the step, so a run is reproducible bit for bit; the checkpoint of step t holds
  the finished batch t + 1 (token ids and log-probs), so a resumed run trains on exactly what the uninterrupted
  one would have. With ``rollout.max_staleness`` k > 1 the same schedule runs k batches ahead: batch t + k is
  launched at step t, so every batch from step k + 1 on is exactly k versions stale.
* ``StreamSource`` (``rollout.async: stream``): a producer thread keeps the engine generating batches into a
  queue of ``rollout.queue_size`` (0: ``max_staleness``) finished batches; the weights go out after every
  ``rollout.sync_every`` steps (and before an evaluation). A batch whose lag exceeds ``rollout.max_staleness`` on
  any rank is dropped by every rank (``stale: drop``) or kept for the rollout correction (``stale: correct``). The
  checkpoint holds the sampler's position before the oldest batch not yet trained on, so a resume draws those
  prompts again (their samples are not saved: the stream's timing is not reproducible anyway).

Each rank's source asks its own engine for its share of every global batch, in the same order, so the k-th batch
is the same prompts on every rank; keep/drop decisions are agreed over ranks.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastcov.trainer.rollout.async_engine import AsyncEngine, Generated
from fastcov.trainer.rollout.base import RolloutBatch, SamplingParams, sample_seed
from fastcov.trainer.runtime.distributed import all_max, all_sum, world_size


@dataclass
class Drawn:
    """One generation batch on this rank: its examples, the prompts (each ``rollout.n`` times), the responses and
    the version that drew them."""

    examples: list
    prompts: list[list[int]]
    out: RolloutBatch
    version: int


def version_lag(step: int, version: int) -> int:
    """How many versions older than the policy that trains ``step`` (version step − 1) a batch of ``version`` is."""
    return step - 1 - version


def request(cfg, batch_idx: list[int], train_set, rank: int, world: int, seed_step: int,
            n_batches: int) -> tuple[list, list[list[int]], SamplingParams]:
    """(examples, prompts, sampling) of this rank's share of the global batch ``batch_idx``: the same prompts and
    per-sample seeds ``collect_rollouts`` gives batch ``n_batches`` of step ``seed_step`` (rollout.seeding:
    per_sample)."""
    t, r = cfg.trainer, cfg.rollout
    local = t.prompts_per_step // world
    examples = [train_set[i] for i in batch_idx[rank * local : (rank + 1) * local]]
    prompts = [ex.prompt_ids for ex in examples for _ in range(r.n)]
    first = (n_batches - 1) * t.prompts_per_step + rank * local
    seeds = [sample_seed(t.seed, seed_step, first + i // r.n, i % r.n) for i in range(len(prompts))]
    return examples, prompts, SamplingParams(r.temperature, r.top_p, r.max_new_tokens, seeds=seeds)


@dataclass
class StepLog:
    """What a step drew: (lag, samples) per kept batch, the samples dropped, the batches waiting when asked."""

    lags: list[tuple[int, int]] = field(default_factory=list)
    dropped: int = 0
    depth: list[int] = field(default_factory=list)
    tokens: int = 0  # response tokens the engine generated for the batches drawn (kept or dropped), this rank


class Source:
    """What the two schedules share: the engine, the run's sampler and data, the staleness log."""

    def __init__(self, cfg, engine: AsyncEngine, sampler, train_set, rank: int, counters: dict,
                 device: torch.device):
        self.cfg = cfg
        self.engine = engine
        self.sampler = sampler
        self.train_set = train_set
        self.rank, self.world = rank, world_size()
        self.counters = counters
        self.device = device
        self.log = StepLog()
        counters.setdefault("stale_dropped", 0)

    def draw(self, step: int, n: int) -> Drawn:
        raise NotImplementedError

    def collected(self, step: int) -> None:  # noqa: B027 - optional hook
        pass

    def push_due(self, step: int) -> bool:
        return True

    def before_push(self, trainer_version: int) -> None:  # noqa: B027 - optional hook
        """Before the weights of step ``trainer_version`` go out: what must finish with the old ones."""

    def save(self, ckpt_dir: Path) -> None:  # noqa: B027 - optional hook
        """What the checkpoint of the current step needs beyond the trainer state (every rank)."""

    def load(self, ckpt_dir: Path, step: int) -> None:  # noqa: B027 - optional hook
        """Read back what ``save`` wrote into the checkpoint of ``step``."""

    def state(self) -> dict:
        """Goes into the trainer state (rank 0's)."""
        return {}

    def load_state(self, state: dict | None) -> None:  # noqa: B027 - optional hook
        pass

    def sampler_state(self) -> dict:
        return self.sampler.state_dict()

    def close(self) -> None:
        self.engine.close()

    def refill(self, step: int, n: int) -> Drawn:
        """A refill batch of DAPO's dynamic sampling, generated now by the engine's current weights."""
        examples, prompts, sampling = request(self.cfg, self.sampler.next(self.cfg.trainer.prompts_per_step),
                                              self.train_set, self.rank, self.world, step, n)
        got = self.engine.generate_now(prompts, sampling, step - 1)
        return self._keep(step, Drawn(examples, prompts, got.out, got.version))

    def _keep(self, step: int, drawn: Drawn) -> Drawn:
        self.log.lags.append((version_lag(step, drawn.version), len(drawn.prompts)))
        self.log.tokens += sum(len(x) for x in drawn.out.token_ids)
        return drawn

    def step_metrics(self) -> dict[str, float]:
        """``async/*`` of the step over all ranks (every rank must call it): staleness mean and max over the
        samples trained on, finished batches waiting when the trainer asked (mean over ranks and draws), the
        engine's version, the response tokens generated for the step (dropped batches' included); the step's drops
        go into the ``stale_dropped`` counter (samples, all ranks)."""
        log, self.log = self.log, StepLog()
        lag_sum = sum(lag * n for lag, n in log.lags)
        samples = sum(n for _, n in log.lags)
        s_lag, s_n, s_depth, s_draws, s_tokens = all_sum(
            [lag_sum, samples, sum(log.depth), len(log.depth), log.tokens], self.device)
        worst = all_max(max((lag for lag, _ in log.lags), default=0), self.device)
        self.counters["stale_dropped"] += log.dropped
        return {"async/staleness_mean": s_lag / max(s_n, 1), "async/staleness_max": worst,
                "async/queue_depth": s_depth / max(s_draws, 1), "async/engine_version": self.engine.version,
                "async/generated_tokens": int(s_tokens)}


@dataclass
class Pending:
    """The batch of step ``step`` (global prompt indices ``batch_idx``), in flight (a Future) or finished."""

    step: int
    batch_idx: list[int]
    examples: list
    prompts: list[list[int]]
    sampling: SamplingParams
    got: Future | Generated


class OneStepSource(Source):
    """``rollout.async: one_step`` (module docstring), ``depth`` batches ahead (``rollout.max_staleness``, 1 unless
    set): batch t + depth is launched when step t's rollouts are collected, so from step depth + 1 on every batch is
    exactly ``depth`` versions stale (a fixed lag: the async study's staleness 4)."""

    def __init__(self, *args, max_steps: int, depth: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_steps = max_steps
        self.depth = max(1, int(depth))
        self.pending: deque[Pending] = deque()  # batches of the next steps, oldest first

    def _launch(self, step: int) -> None:
        batch_idx = self.sampler.next(self.cfg.trainer.prompts_per_step)
        examples, prompts, sampling = request(self.cfg, batch_idx, self.train_set, self.rank, self.world, step, 1)
        self.pending.append(Pending(step, batch_idx, examples, prompts, sampling,
                                    self.engine.generate_async(prompts, sampling)))

    def _finish(self, p: Pending, trainer_version: int) -> Generated:
        if isinstance(p.got, Future):
            p.got = self.engine.result(p.got, p.prompts, p.sampling, trainer_version)
        return p.got

    def draw(self, step: int, n: int) -> Drawn:
        if n > 1:
            return self.refill(step, n)
        if not self.pending:  # the run's first step, or a resume from a checkpoint without the batches
            for ahead in range(step, min(step + self.depth, self.max_steps + 1)):
                self._launch(ahead)
        p = self.pending.popleft()
        assert p.step == step, f"one_step: the batch of step {p.step} drawn at step {step}"
        self.log.depth.append(int(not isinstance(p.got, Future) or p.got.done()))
        got = self._finish(p, step - 1)
        return self._keep(step, Drawn(p.examples, p.prompts, got.out, got.version))

    def collected(self, step: int) -> None:
        if step + self.depth <= self.max_steps:
            self._launch(step + self.depth)  # with the weights after step - 1, while step trains

    def before_push(self, trainer_version: int) -> None:
        for p in self.pending:  # batches up to t + depth finish with the weights they were launched with
            self._finish(p, trainer_version)

    def save(self, ckpt_dir: Path) -> None:
        """This rank's finished batches of the next steps into ``ckpt_dir/async_rank<r>.json`` (fsynced)."""
        self.before_push(self.engine.version)  # after the step's push: the engine's version is the policy's
        batches = [{"step": p.step, "batch_idx": p.batch_idx, "token_ids": p.got.out.token_ids,
                    "logprobs": p.got.out.logprobs, "version": p.got.version}
                   for p in self.pending if isinstance(p.got, Generated)]
        with open(Path(ckpt_dir) / f"async_rank{self.rank}.json", "w") as f:
            json.dump({"batches": batches}, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, ckpt_dir: Path, step: int) -> None:
        """The batches of the steps after ``step`` from its checkpoint (none there: generated afresh)."""
        path = Path(ckpt_dir) / f"async_rank{self.rank}.json"
        if not path.is_file():
            return
        for i, b in enumerate(json.loads(path.read_text())["batches"]):
            if int(b["step"]) != step + 1 + i:
                raise ValueError(f"{path}: holds the batch of step {b['step']}, expected {step + 1 + i}")
            batch_idx = [int(x) for x in b["batch_idx"]]
            examples, prompts, sampling = request(self.cfg, batch_idx, self.train_set, self.rank, self.world,
                                                  step + 1 + i, 1)
            out = RolloutBatch([[int(x) for x in row] for row in b["token_ids"]],
                               [[float(x) for x in row] for row in b["logprobs"]])
            if len(out.token_ids) != len(prompts):
                raise ValueError(f"{path}: {len(out.token_ids)} responses for {len(prompts)} prompts")
            self.pending.append(Pending(step + 1 + i, batch_idx, examples, prompts, sampling,
                                        Generated(out, int(b["version"]), 0.0, 0.0)))

    def close(self) -> None:
        for p in self.pending:
            if isinstance(p.got, Future):
                p.got.cancel()
        super().close()


@dataclass
class Produced:
    """The stream's batch number ``index`` (it draws with the seeds of step index + 1), the sampler's state
    before its prompts were drawn, and once finished what the engine generated."""

    index: int
    sampler_before: dict
    examples: list
    prompts: list[list[int]]
    sampling: SamplingParams
    got: Generated | None = None


class StreamSource(Source):
    """``rollout.async: stream`` (module docstring). ``eval_due(step)``: whether the run evaluates after ``step``
    (the engine then gets that step's weights first)."""

    def __init__(self, *args, eval_due: Callable[[int], bool] = lambda step: False, **kwargs):
        super().__init__(*args, **kwargs)
        r = self.cfg.rollout
        self.capacity = r.queue_size or r.max_staleness
        self.eval_due = eval_due
        self.queue: deque[Produced] = deque()
        self.produced = 0  # the next batch's number
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._inflight: Produced | None = None
        self._retry: Produced | None = None  # a batch whose engine died under it, asked again after a restart
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ producer

    def _next_item(self) -> Produced | None:
        """Under the lock: the next batch to ask for (None: stop)."""
        while not self._stop and len(self.queue) >= self.capacity:
            self._cv.wait()
        if self._stop:
            return None
        if self._retry is not None:
            item, self._retry = self._retry, None
            return item
        before = self.sampler.state_dict()
        batch_idx = self.sampler.next(self.cfg.trainer.prompts_per_step)
        examples, prompts, sampling = request(self.cfg, batch_idx, self.train_set, self.rank, self.world,
                                              self.produced + 1, 1)
        self.produced += 1
        return Produced(self.produced - 1, before, examples, prompts, sampling)

    def _produce(self) -> None:
        while True:
            with self._cv:
                item = self._next_item()
                self._inflight = item
            if item is None:
                return
            try:
                item.got = self.engine.run_generation(item.prompts, item.sampling)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises or restarts
                with self._cv:
                    self.error, self._retry, self._inflight = exc, item, None
                    self._cv.notify_all()
                return
            with self._cv:
                self.queue.append(item)
                self._inflight = None
                self._cv.notify_all()

    def _start(self) -> None:
        self.error, self._stop = None, False
        self._thread = threading.Thread(target=self._produce, name="fastcov-stream", daemon=True)
        self._thread.start()

    def _take(self, step: int) -> tuple[Produced, int]:
        """The oldest finished batch and how many were waiting; a producer that failed is restarted once the
        engine is (``AsyncEngine.recover``, which raises when no restart is left)."""
        if self._thread is None:
            self._start()
        with self._cv:
            depth = len(self.queue)
            while not self.queue and self.error is None:
                self._cv.wait(timeout=1.0)
            error = self.error if not self.queue else None
        if error is not None:
            from fastcov.trainer.rollout.engine_process import EngineDied

            if not isinstance(error, EngineDied):
                raise error
            self.engine.recover(error, step - 1)
            self._start()
            return self._take(step)
        with self._cv:
            item = self.queue.popleft()
            self._cv.notify_all()
        return item, depth

    # ------------------------------------------------------------------------------------------ the loop's side

    def draw(self, step: int, n: int) -> Drawn:
        """The oldest finished batch whose lag is within ``rollout.max_staleness`` on every rank (``stale:
        correct``: the oldest, whatever its lag); DAPO's refills take the next ones the same way."""
        r = self.cfg.rollout
        while True:
            item, depth = self._take(step)
            assert item.got is not None
            worst = all_max(version_lag(step, item.got.version), self.device)
            if worst > r.max_staleness and r.stale == "drop":
                self.log.dropped += self.cfg.trainer.prompts_per_step * r.n
                self.log.tokens += sum(len(x) for x in item.got.out.token_ids)
                continue
            self.log.depth.append(depth)
            return self._keep(step, Drawn(item.examples, item.prompts, item.got.out, item.got.version))

    def push_due(self, step: int) -> bool:
        return step % self.cfg.rollout.sync_every == 0 or self.eval_due(step)

    def sampler_state(self) -> dict:
        """The sampler before the oldest batch not trained on yet: a resume draws those prompts again."""
        with self._cv:
            waiting = list(self.queue) + [x for x in (self._inflight, self._retry) if x is not None]
            if waiting:
                return min(waiting, key=lambda x: x.index).sampler_before
            return self.sampler.state_dict()

    def state(self) -> dict:
        with self._cv:
            waiting = list(self.queue) + [x for x in (self._inflight, self._retry) if x is not None]
            return {"batches": min((x.index for x in waiting), default=self.produced)}

    def load_state(self, state: dict | None) -> None:
        if state:
            self.produced = int(state["batches"])

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.engine.close()  # a generation in flight ends with the engine
        if self._thread is not None:
            self._thread.join(timeout=60.0)


def make_source(cfg, engine: AsyncEngine, sampler, train_set, rank: int, counters: dict, device: torch.device,
                eval_due: Callable[[int], bool]) -> Source:
    """The source ``rollout.async`` names (one_step or stream)."""
    if cfg.rollout.async_mode == "one_step":
        return OneStepSource(cfg, engine, sampler, train_set, rank, counters, device,
                             max_steps=cfg.trainer.max_steps, depth=cfg.rollout.max_staleness)
    if cfg.rollout.async_mode == "stream":
        return StreamSource(cfg, engine, sampler, train_set, rank, counters, device, eval_due=eval_due)
    raise ValueError(f"rollout.async: no source for {cfg.rollout.async_mode!r}")
