"""The Hugging Face rollout engine in a process of its own, for asynchronous rollouts (``rollout.async``).

    engine = EngineProcess(spec, log_path)       # starts ``python -m fastcov.trainer.rollout.engine_worker``
    engine.update_weights(policy.weight_buckets(64))   # bucketed, as into any engine
    out = engine.generate(prompts, SamplingParams(1.0, 1.0, 64, seeds=[...]))
    engine.close()

Trainer rank and worker talk over a gloo group of their own: a ``TCPStore`` hosted by the trainer and a
two-rank ``ProcessGroupGloo`` (the transport of ``fastcov_gloo``, vllm_plugin.py; no default process group is
touched on either side, so DeepSpeed's stays the data-parallel one). ``Channel`` sends pickled requests and
replies and flat buckets with the group's own ``send``/``recv``, in order, one call at a time. Requests:
``generate`` (prompts, sampling knobs, per-sample seeds) → token ids and sampling log-probs; ``update`` → one
``bucket`` (``BucketMeta`` + flat uint8 tensor) after another → ``end`` → the number of tensors loaded; ``stop``.

Faults. The worker asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``) and exits when the
channel breaks, so a killed trainer leaves no engine behind; it ignores SIGINT (a Ctrl-C in the terminal is the
trainer's to handle). A worker that dies makes the next call raise ``EngineDied`` (a ``RolloutError``) naming
its rank, pid, exit status and log file (``<run>/engine/rank<r>.log``, its stderr).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fastcov.trainer.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from fastcov.trainer.runtime.errors import RolloutError, last_intact
from fastcov.trainer.runtime.weight_buckets import as_buckets

START_TIMEOUT_S = 600.0  # the worker's imports and model on a loaded machine
WORKER = "fastcov.trainer.rollout.engine_worker"


class EngineDied(RolloutError):
    """The engine process is gone (killed, crashed) or its channel broke."""


@contextlib.contextmanager
def engine_failure(step: int, ckpt_root: Path) -> Iterator[None]:
    """An asynchronous run's engine process that dies during a push or an evaluation of ``step``: one line with the
    step and the last intact checkpoint (a death during the rollouts is said by the loop's collect_rollouts)."""
    try:
        yield
    except EngineDied as exc:
        raise RolloutError(f"rollout engine failed at step {step}: {exc}; the last intact checkpoint is "
                           f"{last_intact(ckpt_root)}; resume with --resume") from None


@dataclass
class WorkerSpec:
    """What the worker needs to build its engine (``spec.json`` beside the HF ``config.json`` in ``model_dir``)."""

    model_dir: str  # the policy's Hugging Face config (save_pretrained), no weights: they come with the first sync
    dtype: str  # torch dtype name of the policy's parameters ("float32", "bfloat16")
    device: str  # "cpu" or "cuda:N"
    attn_implementation: str
    eos_token_ids: list[int]
    pad_token_id: int
    batch_size: int = 0
    token_budget: int = 0
    threads: int = 1  # torch intra-op threads (0: torch's default)
    lora: dict | None = None  # the model section's lora_rank, lora_alpha, lora_dropout, lora_targets
    rank: int = 0  # the trainer rank it samples for (names and log lines)
    timeout_s: float = 86400.0  # how long either side waits for the other inside a call
    host: str = "127.0.0.1"
    port: int = 0
    parent_pid: int = 0


class Channel:
    """Rank ``rank`` (0: the trainer, 1: the worker) of a two-rank gloo group on ``store``: pickled objects and
    uint8 tensors, each in order. Every failure of the group raises RuntimeError (gloo's)."""

    def __init__(self, store, rank: int, host: str, timeout_s: float):
        import torch.distributed as dist

        from fastcov.trainer.rollout.vllm_plugin import local_address

        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in torch's stubs
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host, 1))]
        self.group = dist.ProcessGroupGloo(store, rank, 2, opts)
        self.peer = 1 - rank

    def send(self, obj) -> None:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.group.send([torch.tensor([len(payload)], dtype=torch.int64)], self.peer, 0).wait()  # type: ignore[attr-defined]
        self.group.send([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], self.peer, 1).wait()  # type: ignore[attr-defined]

    def recv(self):
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], self.peer, 0).wait()  # type: ignore[attr-defined]  # bound by torch's C++, no stub
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
        self.group.recv([buf], self.peer, 1).wait()  # type: ignore[attr-defined]
        return pickle.loads(buf.numpy().tobytes())  # noqa: S301 - the peer is this run's own process

    def send_tensor(self, flat: torch.Tensor) -> None:
        if flat.numel():
            self.group.send([flat.contiguous()], self.peer, 2).wait()  # type: ignore[attr-defined]

    def recv_tensor(self, nbytes: int) -> torch.Tensor:
        flat = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self.group.recv([flat], self.peer, 2).wait()  # type: ignore[attr-defined]
        return flat


def exit_description(code: int | None) -> str:
    """'killed by SIGKILL', 'exited with status 3', 'still running'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class EngineProcess(RolloutEngine):
    """The trainer's end of one engine worker (see the module docstring), started at construction. Not
    thread-safe: one call at a time (``AsyncEngine`` serialises them). ``last_stats``: the worker's tokens,
    seconds, tokens/s of the last ``generate``."""

    def __init__(self, spec: WorkerSpec, log_path: Path, device: torch.device | None = None):
        self.spec = spec
        self.log_path = Path(log_path)
        self.device = device if device is not None else torch.device("cpu")
        self.last_stats: dict = {}
        self.proc: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self._store: Any = None  # the TCPStore the worker joins
        self.start()

    # ------------------------------------------------------------------------------------------ life

    def start(self) -> None:
        """Start a worker (a fresh one after ``close`` or a death) and wait until it is ready."""
        import torch.distributed as dist

        from fastcov.trainer.runtime.distributed import free_port

        self.close()
        spec = self.spec
        spec.parent_pid = os.getpid()
        for attempt in range(5):  # a port free a moment ago may be taken by the time the store binds it
            spec.port = free_port()
            try:
                self._store = dist.TCPStore(spec.host, spec.port, 2, True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=spec.timeout_s))
                break
            except RuntimeError:
                if attempt == 4:
                    raise
        model_dir = Path(spec.model_dir)
        (model_dir / "spec.json").write_text(json.dumps(asdict(spec), indent=1))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", WORKER, str(model_dir / "spec.json")],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._store.check(["ready"]):
            if self.proc.poll() is not None:
                raise EngineDied(f"the HF engine process of rank {spec.rank} did not start: it "
                                 f"{exit_description(self.proc.returncode)}: {self._log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineDied(f"the HF engine process of rank {spec.rank} was not ready within "
                                 f"{START_TIMEOUT_S:.0f} s (its log: {self.log_path})")
            time.sleep(0.02)
        self.channel = Channel(self._store, 0, spec.host, spec.timeout_s)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _log_tail(self) -> str:
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return (lines[-1][:300] if lines else "no output") + f" (its log: {self.log_path})"

    def died(self, exc: BaseException | None = None) -> EngineDied:
        """The error that says this worker is gone (waits a moment for its exit status)."""
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                code = None
        how = exit_description(code) if code is not None else f"its channel broke: {str(exc).splitlines()[0][:200]}"
        return EngineDied(f"the HF engine process of rank {self.spec.rank} (pid {self.pid}) died ({how}; its log: "
                          f"{self.log_path}; rollout.engine_restarts restarts it)")

    def _call(self, request: dict):
        if self.channel is None or self.proc is None or self.proc.poll() is not None:
            raise self.died()
        broken = None
        try:
            self.channel.send(request)
            reply = self.channel.recv()
        except RuntimeError as exc:
            broken = exc
        if broken is not None:  # raised outside the handler: gloo's error is no part of the chain (not a lost rank)
            raise self.died(broken)
        if "error" in reply:
            raise RolloutError(f"the HF engine process of rank {self.spec.rank}: {reply['error']}")
        return reply

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Stop the worker (ask, then kill after 10 s); the worker's exit is waited for, so none is left."""
        if self.proc is not None and self.proc.poll() is None and self.channel is not None:
            try:
                self.channel.send({"op": "stop"})
                self.proc.wait(10.0)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.proc, self.channel, self._store = None, None, None

    # ------------------------------------------------------------------------------------------ engine

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        """``generator`` is not used: the worker has its own; sampled rollouts need per-sample seeds."""
        if not prompts:
            return RolloutBatch([], [])
        if sampling.temperature > 0 and sampling.seeds is None:
            raise ValueError("EngineProcess.generate: sampling needs per-sample seeds (rollout.seeding: per_sample)")
        reply = self._call({"op": "generate", "prompts": [list(map(int, p)) for p in prompts],
                            "sampling": asdict(sampling)})
        self.last_stats = reply["stats"]
        return RolloutBatch(reply["token_ids"], reply["logprobs"])

    def update_weights(self, named_tensors: Iterable) -> None:
        """Every bucket flattened into host memory and sent; returns once the worker has loaded them all."""
        if self.channel is None or self.proc is None or self.proc.poll() is not None:
            raise self.died()
        broken = None
        try:
            self.channel.send({"op": "update"})
            for bucket in as_buckets(named_tensors):
                meta = bucket.meta()
                self.channel.send({"op": "bucket", "meta": meta.to_json()})
                self.channel.send_tensor(bucket.flatten(device="cpu"))
            self.channel.send({"op": "end"})
            reply = self.channel.recv()
        except RuntimeError as exc:
            broken = exc
        if broken is not None:
            raise self.died(broken)
        if "error" in reply:
            raise RolloutError(f"the HF engine process of rank {self.spec.rank}: weight sync: {reply['error']}")
