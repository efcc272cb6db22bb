"""Asynchronous rollouts' engine side: the HF engine in a process of its own (its channel, weight sync, faults),
``AsyncEngine``'s one-request-at-a-time rule, and the one_step / stream schedules on fake engines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from fastcov.trainer.rollout.async_engine import AsyncEngine, Generated, worker_spec
from fastcov.trainer.rollout.base import RolloutBatch, RolloutEngine, SamplingParams, sample_seed
from fastcov.trainer.rollout.engine_process import EngineDied, EngineProcess, exit_description
from fastcov.trainer.rollout.hf import HFRolloutEngine
from fastcov.trainer.rollout.staleness import OneStepSource, StreamSource, version_lag
from fastcov.trainer.runtime.weight_buckets import iter_buckets


def tiny_lm(seed=0, vocab=97):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                               max_position_embeddings=128, eos_token_id=3, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # eos likely enough that rows finish at different steps
        model.lm_head.weight[3] *= 6.0
    return model


def run_cfg(**rollout):
    r = SimpleNamespace(**{"batch_size": 0, "token_budget": 0, "n": 2, "temperature": 1.0, "top_p": 1.0,
                           "max_new_tokens": 6, "queue_size": 0, "max_staleness": 1, "stale": "drop", "sync_every": 1,
                           **rollout})
    return SimpleNamespace(rollout=r, trainer=SimpleNamespace(threads=1, collective_timeout_s=0.0, seed=5,
                                                              prompts_per_step=2))


def seeded(prompts, step=1):
    return SamplingParams(1.0, 1.0, 6, seeds=[sample_seed(5, step, i, 0) for i in range(len(prompts))])


PROMPTS = [[5, 9, 11], [7, 8], [20, 21, 22, 23], [4]]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One engine process for the module's tests (its start costs seconds)."""
    model = tiny_lm()
    # frozen, as the worker's copy is: parameters that require grad take another CPU path, 1 ulp off in log-probs
    model.requires_grad_(False)
    tok = SimpleNamespace(eos_token_id=3, pad_token_id=0)
    tmp = tmp_path_factory.mktemp("engine")
    spec = worker_spec(run_cfg(), model, tok, torch.device("cpu"), 0, tmp / "rank0")
    engine = EngineProcess(spec, tmp / "rank0.log")
    yield model, engine
    engine.close()


def test_the_engine_process_samples_what_the_policy_samples_after_a_sync(worker):
    model, engine = worker
    torch.set_num_threads(1)  # the worker's count (spec.threads): the same kernels, so the same rounding
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # not the weights the worker was built with
    engine.update_weights(iter_buckets(list(model.named_parameters()) + list(model.named_buffers()), 4096))
    local = HFRolloutEngine(model, [3], 0, shares_policy=True)
    want = local.generate(PROMPTS, seeded(PROMPTS))
    got = engine.generate(PROMPTS, seeded(PROMPTS))
    assert got.token_ids == want.token_ids  # the same draws from the same weights and seeds
    assert got.logprobs == want.logprobs  # bit for bit: same model, same kernels, one thread each
    assert engine.last_stats["tokens"] == sum(map(len, want.token_ids))
    # a second sync with other weights changes the samples: the update really lands
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    engine.update_weights(iter_buckets(model.named_parameters(), 0))
    assert engine.generate(PROMPTS, seeded(PROMPTS)).logprobs == local.generate(PROMPTS, seeded(PROMPTS)).logprobs


def test_a_bad_push_is_one_error_and_the_channel_stays_in_step(worker):
    model, engine = worker
    bad = [("model.no_such.weight", torch.zeros(3)), ("lm_head.weight", model.lm_head.weight.detach())]
    with pytest.raises(RuntimeError, match="weight sync: KeyError: .*no_such"):
        engine.update_weights(iter_buckets(bad, 0))
    with pytest.raises(ValueError, match="per-sample seeds"):
        engine.generate(PROMPTS, SamplingParams(1.0, 1.0, 4))
    assert len(engine.generate(PROMPTS, seeded(PROMPTS)).token_ids) == len(PROMPTS)  # still answering in order


def test_a_killed_engine_process_is_named_in_one_error(tmp_path):
    spec = worker_spec(run_cfg(), tiny_lm(), SimpleNamespace(eos_token_id=3, pad_token_id=0), torch.device("cpu"),
                       1, tmp_path / "rank1")
    engine = EngineProcess(spec, tmp_path / "rank1.log")
    try:
        pid = engine.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDied) as err:
            engine.generate(PROMPTS, seeded(PROMPTS))
        msg = str(err.value)
        assert f"rank 1 (pid {pid}) died (killed by SIGKILL" in msg and "rank1.log" in msg, msg
        assert "\n" not in msg
    finally:
        engine.close()
    assert exit_description(3) == "exited with status 3"


PARENT = r"""
import sys, time, torch
from types import SimpleNamespace
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_async_engine import tiny_lm, run_cfg
from fastcov.trainer.rollout.async_engine import worker_spec
from fastcov.trainer.rollout.engine_process import EngineProcess
tmp = Path(sys.argv[1])
spec = worker_spec(run_cfg(), tiny_lm(), SimpleNamespace(eos_token_id=3, pad_token_id=0), torch.device("cpu"), 0, tmp)
engine = EngineProcess(spec, tmp / "log")
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_trainer_leaves_no_engine_process(tmp_path):
    """SIGKILL of the process that started the engine (a trainer rank): the kernel kills the engine with it."""
    here = os.path.dirname(os.path.abspath(__file__))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), here], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), line
        child = int(line)
        assert os.path.exists(f"/proc/{child}")
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{child}") and "Z" not in _state(child):
            assert time.monotonic() < deadline, "the engine process outlived its trainer by 30 s"
            time.sleep(0.05)
    finally:
        parent.kill()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ----------------------------------------------------------------------------------------- AsyncEngine, fakes


class SlowEngine(RolloutEngine):
    """Records the order of what reaches it; a generation takes ``delay`` seconds; responses encode the weights."""

    def __init__(self, delay=0.2):
        self.delay, self.log, self.weights, self.device = delay, [], 0, torch.device("cpu")

    def generate(self, prompts, sampling, generator=None):
        self.log.append(("generate start", self.weights))
        time.sleep(self.delay)
        self.log.append(("generate end", self.weights))
        return RolloutBatch([[self.weights] for _ in prompts], [[-1.0] for _ in prompts])

    def update_weights(self, named_tensors):
        items = list(named_tensors)
        self.log.append(("push", items[0][1]))
        self.weights = items[0][1]


def test_a_push_waits_for_the_generation_in_flight_and_goes_before_the_next():
    fake = SlowEngine()
    engine = AsyncEngine(fake, torch.device("cpu"))
    first = engine.generate_async([[1]], SamplingParams())
    time.sleep(0.05)  # the first generation is in flight
    second = engine.generate_async([[1]], SamplingParams())  # queued behind it
    engine.update_weights([("w", 7)], version=3)  # waits for the first, then goes before the second
    a, b = first.result(), second.result()
    assert [x[0] for x in fake.log] == ["generate start", "generate end", "push", "generate start", "generate end"]
    assert (a.version, a.out.token_ids) == (0, [[0]]) and (b.version, b.out.token_ids) == (3, [[7]])
    assert engine.version == 3
    engine.close()
    with pytest.raises(EngineDied, match="closed"):
        engine.generate([[1]], SamplingParams())


class VersionedEngine:
    """A stand-in for AsyncEngine: generations finish at once; responses are the prompts; version settable."""

    def __init__(self):
        self.version, self.asked = 0, []
        self.device = torch.device("cpu")

    def run_generation(self, prompts, sampling):
        self.asked.append((self.version, [p[0] for p in prompts[:: 2]], list(sampling.seeds)))
        return Generated(RolloutBatch([list(p) for p in prompts], [[0.0] * len(p) for p in prompts]),
                         self.version, 0.0, 0.0)

    def generate_async(self, prompts, sampling):
        fut = Future()
        fut.set_result(self.run_generation(prompts, sampling))
        return fut

    def result(self, fut, prompts, sampling, trainer_version):
        return fut.result()

    def generate_now(self, prompts, sampling, trainer_version):
        return self.run_generation(prompts, sampling)

    def close(self):
        pass


class Counter:
    """A PromptSampler stand-in: 0, 1, 2, ..."""

    def __init__(self):
        self.pos = 0

    def next(self, n):
        self.pos += n
        return list(range(self.pos - n, self.pos))

    def state_dict(self):
        return {"pos": self.pos}


DATA = [SimpleNamespace(prompt_ids=[100 + i]) for i in range(64)]


def test_one_step_draws_batch_t_plus_1_with_the_weights_after_step_t_minus_1():
    eng, sampler = VersionedEngine(), Counter()
    src = OneStepSource(run_cfg(), eng, sampler, DATA, 0, {}, torch.device("cpu"), max_steps=4)
    seen = []
    for step in range(1, 5):
        drawn = src.draw(step, 1)
        seen.append((step, drawn.version, drawn.prompts[0][0]))
        src.collected(step)  # batch step + 1 starts here
        src.before_push(step)
        eng.version = step  # the push after the step's update
    # batch 1 and 2 from the starting weights, then batch t from version t - 2: one version stale from step 2
    assert seen == [(1, 0, 100), (2, 0, 102), (3, 1, 104), (4, 2, 106)]
    assert [version_lag(s, v) for s, v, _ in seen] == [0, 1, 1, 1]
    # the same prompts and seeds as the synchronous loop gives step t's batch (collect_rollouts' rule)
    assert eng.asked[1][2] == [sample_seed(5, 2, i // 2, i % 2) for i in range(4)]
    m = src.step_metrics()
    assert m["async/staleness_max"] == 1 and m["async/staleness_mean"] == pytest.approx(3 / 4)


def test_one_step_k_batches_ahead_gives_every_batch_a_lag_of_exactly_k(tmp_path):
    eng, sampler = VersionedEngine(), Counter()
    src = OneStepSource(run_cfg(), eng, sampler, DATA, 0, {}, torch.device("cpu"), max_steps=7, depth=3)
    lags = []
    for step in range(1, 8):
        lags.append(version_lag(step, src.draw(step, 1).version))
        src.collected(step)
        if step == 4:  # a checkpoint after step 4 holds batches 5-7; a fresh source resumes from them
            src.save(tmp_path)
            again = OneStepSource(run_cfg(), VersionedEngine(), Counter(), DATA, 0, {}, torch.device("cpu"),
                                  max_steps=7, depth=3)
            again.load(tmp_path, 4)
            assert [(p.step, p.got.version, p.prompts) for p in again.pending] == [
                (p.step, p.got.version, p.prompts) for p in src.pending]
        src.before_push(step)
        eng.version = step
    assert lags == [0, 1, 2, 3, 3, 3, 3]


def test_stream_drops_what_is_too_stale_on_every_rank_and_checkpoints_the_oldest_waiting_batch():
    eng, sampler = VersionedEngine(), Counter()
    counters = {}
    src = StreamSource(run_cfg(max_staleness=1, queue_size=3), eng, sampler, DATA, 0, counters,
                       torch.device("cpu"))
    first = src.draw(1, 1)  # starts the producer: three batches of version 0 queue up
    assert first.version == 0 and first.prompts[0] == [100]
    deadline = time.monotonic() + 10
    while len(src.queue) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert src.sampler_state() == {"pos": 2} and src.state() == {"batches": 1}  # a resume draws batch 1 again
    eng.version = 2  # pushes after steps 1 and 2; step 3 trains version 2
    drawn = src.draw(4, 1)  # lag 3 - 0 = 3 > 1: the queued version-0 batches go, the next fresh one comes
    assert drawn.version == 2
    src.step_metrics()
    assert counters["stale_dropped"] == 3 * 2 * 2  # three batches of 2 prompts x 2 samples
    src.close()


def test_stream_correct_keeps_stale_batches():
    eng = VersionedEngine()
    src = StreamSource(run_cfg(max_staleness=1, stale="correct", queue_size=2), eng, Counter(), DATA, 0, {},
                       torch.device("cpu"))
    src.draw(1, 1)
    while len(src.queue) < 2:
        time.sleep(0.01)
    eng.version = 5
    assert src.draw(9, 1).version == 0  # lag 8, kept for the correction
    src.close()


def test_stream_pushes_every_sync_every_steps_and_before_evaluations():
    src = StreamSource(run_cfg(sync_every=3), VersionedEngine(), Counter(), DATA, 0, {}, torch.device("cpu"),
                       eval_due=lambda step: step == 4)
    assert [s for s in range(1, 10) if src.push_due(s)] == [3, 4, 6, 9]
