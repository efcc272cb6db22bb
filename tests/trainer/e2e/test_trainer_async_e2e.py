"""Asynchronous rollouts in the loop (rollout.async, docs/async.md) on the tiny config with the HF engine in its own
process: one_step's fixed schedule (its first step is the synchronous run's, and a run SIGKILLed at a random
moment and resumed equals the uninterrupted one bit for bit, with no engine process left behind), stream's drops
and resume, an engine that dies (one line, or a restart), LoRA's adapter reaching the engine, the algorithms that
must keep working (the config's one-line refusals: tests/trainer/loop/test_trainer_async.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import _fixtures  # noqa: E402
from _dist import without_rank_environment  # noqa: E402
from _fixtures import ROOT, TINY, VOLATILE, tiny  # noqa: E402

from fastcov.trainer import train as train_mod  # noqa: E402
from fastcov.trainer.runtime.run_dir import read_metrics  # noqa: E402

STEPS = 4
# timing, not the run: how many finished batches waited when the trainer asked
TIMING = (*VOLATILE, "async/queue_depth")

pytestmark = pytest.mark.usefixtures("varied_rewards")  # tests/trainer/conftest.py


def stable(rows, drop=TIMING):  # also without the queue depth, which depends on timing
    return _fixtures.stable(rows, drop)


# ------------------------------------------------------------------------------------ one_step, in processes

DRIVER = r'''
import os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
torch.set_num_threads(1)
from fastcov.trainer import train as train_mod
from fastcov.trainer.config import load_config
from fastcov.trainer.rewards import RewardFn
RewardFn.__call__ = lambda self, text, truth: float(len(text) % 2)
run_dir, mode, *over = sys.argv[1:]
cfg = load_config(os.environ["FASTCOV_TINY"], [f"trainer.run_dir={run_dir}", "reward.sandbox=inline", *over])
train_mod.train(cfg, resume=mode == "resume")
print("DONE", flush=True)
'''

# the correction off: then nothing but the sampled tokens connects the engine's numbers to the trainer's (its
# log-probs sit 1 ulp from the in-process engine's: a frozen copy takes another matmul path than the policy's module)
ONE_STEP = ["rollout.async=one_step", f"trainer.max_steps={STEPS}", "trainer.save_every=1", "trainer.eval_every=2",
            "algo.rollout_correction.enabled=false"]


def launch(tmp: Path, run_dir: Path, mode: str, *over: str) -> subprocess.Popen:
    driver = tmp / "driver.py"
    if not driver.exists():
        driver.write_text(DRIVER)
    env = without_rank_environment()
    env.update(DS_ACCELERATOR="cpu", FASTCOV_TINY=str(TINY), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(driver), str(run_dir), mode, *over], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    return out


def params(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def engine_processes(run_dir: Path) -> list[int]:
    """The pids of live engine workers of the run (their command line names its spec file)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run_dir) in cmd and "engine_worker" in cmd and state != "Z":
            pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_step")
    finish(launch(tmp, tmp / "run", "fresh", *ONE_STEP))
    return tmp, read_metrics(tmp / "run" / "metrics.jsonl"), params(tmp / "run")


@pytest.mark.slow
def test_one_step_trains_one_version_behind_and_its_first_step_is_the_synchronous_one(reference):
    tmp, rows, _ = reference
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert [r["async/staleness_max"] for r in rows[1:]] == [0] + [1] * (STEPS - 1)  # batch t+1 from step t-1
    assert [r["async/engine_version"] for r in rows[1:]] == list(range(1, STEPS + 1))
    assert all(r["stale_dropped"] == 0 for r in rows[1:])
    # step 1 is on-policy: the same prompts, seeds and weights as the synchronous loop's step 1, so the same tokens
    sync_dir = tmp / "sync"
    finish(launch(tmp, sync_dir, "fresh", f"trainer.max_steps={STEPS}", "trainer.save_every=1",
                  "trainer.eval_every=2"))
    sync = read_metrics(sync_dir / "metrics.jsonl")
    engine_numbers = ("async/", "stale_dropped", "rollout_logprob_diff")

    def same_tokens(r):
        return {k: v for k, v in r.items() if not k.startswith(engine_numbers)}

    assert [same_tokens(r) for r in stable(sync[:2])] == [same_tokens(r) for r in stable(rows[:2])]
    assert rows[1]["rollout_logprob_diff_max"] < 1e-5  # fp32 sampling vs the fused pass, the same weights
    assert stable(sync[2:3]) != stable(rows[2:3])  # from step 2 on, the batch is one version older


@pytest.mark.slow
def test_one_step_killed_at_a_random_moment_resumes_bit_for_bit_and_leaves_no_engine(reference, tmp_path):
    _, ref_rows, ref_params = reference
    run_dir = tmp_path / "run"
    proc = launch(tmp_path, run_dir, "fresh", *ONE_STEP)
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "step_000001").is_dir():  # a checkpoint holding the next step's batch
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(random.Random(57).uniform(0.0, 0.5))  # a random moment of step 2 or later
    killed = proc.poll() is None
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 30
    while engine_processes(run_dir):  # the kernel kills the engine with its trainer (PR_SET_PDEATHSIG)
        assert time.monotonic() < deadline, f"engine processes outlived the trainer: {engine_processes(run_dir)}"
        time.sleep(0.05)
    out = finish(launch(tmp_path, run_dir, "resume", *ONE_STEP))
    assert "resumed from" in out or not killed, out[-2000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert stable(rows) == stable(ref_rows)
    got = params(run_dir)
    assert got.keys() == ref_params.keys()
    for name in got:
        assert torch.equal(got[name], ref_params[name]), name
    assert not engine_processes(run_dir)


# ------------------------------------------------------------------------------------ stream, faults, in process


@pytest.mark.slow
def test_stream_drops_stale_batches_and_resumes(tmp_path):
    over = ["rollout.async=stream", "rollout.max_staleness=1", "rollout.sync_every=2", "rollout.queue_size=2",
            "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=0", "trainer.timeline=true"]
    cfg = tiny(tmp_path, "run", *over)
    train_mod.train(cfg, stop_at=2)
    train_mod.train(cfg, resume=True)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one row per step across the resume
    assert all(r["async/staleness_max"] <= 1 for r in rows)  # drop keeps nothing older than max_staleness
    assert all(r["async/queue_depth"] <= 2 for r in rows)
    assert [r["stale_dropped"] for r in rows] == sorted(r["stale_dropped"] for r in rows)  # a counter
    spans = [json.loads(line) for line in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    assert {s["lane"] for s in spans} == {"trainer", "engine"}
    assert {"generate", "push"} <= {s["phase"] for s in spans if s["lane"] == "engine"}
    assert all(s["end"] >= s["start"] for s in spans)


def kill_engine_at(monkeypatch, step: int):
    """SIGKILL the run's engine process right before the loop draws step ``step``'s batch."""
    from fastcov.trainer.rollout import staleness

    real = staleness.OneStepSource.draw

    def draw(self, s, n):
        if s == step and n == 1:
            os.kill(self.engine.engine.pid, signal.SIGKILL)
        return real(self, s, n)

    monkeypatch.setattr(staleness.OneStepSource, "draw", draw)


@pytest.mark.slow
def test_an_engine_that_dies_ends_the_run_in_one_line_or_is_restarted(tmp_path, monkeypatch, capsys):
    kill_engine_at(monkeypatch, 2)
    over = ["rollout.async=one_step", "trainer.max_steps=3", "trainer.save_every=1", "trainer.eval_every=0"]
    with pytest.raises(train_mod.RolloutError) as err:
        train_mod.train(tiny(tmp_path, "dies", *over))
    msg = str(err.value)
    assert "\n" not in msg and "step 2" in msg and "died (killed by SIGKILL" in msg, msg
    assert "step_000001" in msg and "--resume" in msg, msg
    assert not engine_processes(tmp_path / "dies")

    run = train_mod.train(tiny(tmp_path, "restarts", *over, "rollout.engine_restarts=1"))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "restarting it (0 restart(s) left)" in capsys.readouterr().err
    # found dead when the batch was asked for, or (its batch already back) at the push: either way filled anew
    assert rows[-1]["async/engine_version"] == 3 and all(r["async/staleness_max"] <= 1 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("mode,seed", [("one_step", 1), ("stream", 2)])
def test_an_engine_killed_at_a_random_moment_is_restarted_and_the_run_finishes(tmp_path, monkeypatch, capsys, mode,
                                                                              seed):
    """A timer kills the engine process somewhere in the run (generating, idle, being pushed to, evaluating); the
    last step waits for it, so the kill lands while the run still has a generation, a push and an evaluation to go."""
    import threading

    from fastcov.trainer.rollout import staleness

    cls = staleness.OneStepSource if mode == "one_step" else staleness.StreamSource
    real, timers, killed = cls.draw, [], []

    def kill(pid):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:  # the engine had already gone: the test would prove nothing
            pass

    def draw(self, s, n):
        if not timers:
            timers.append(threading.Timer(random.Random(seed).uniform(0.0, 1.5), kill, (self.engine.engine.pid,)))
            timers[0].start()
        if s == 4:
            timers[0].join()
        return real(self, s, n)

    monkeypatch.setattr(cls, "draw", draw)
    run = train_mod.train(tiny(tmp_path, "run", f"rollout.async={mode}", "trainer.max_steps=4", "trainer.eval_every=2",
                               "rollout.engine_restarts=1"))
    assert len(killed) == 1
    assert "restarting it (0 restart(s) left)" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert not engine_processes(run)


@pytest.mark.slow
@pytest.mark.parametrize("over", [
    ["algo.mode=kl_cov", "algo.entropy_control.target=4.0", "algo.entropy_control.knob=kl_cov_coef",
     "algo.entropy_control.delta=0.5", "algo.pos_weight.enabled=true", "algo.dapo_filter=true",
     "algo.max_gen_batches=3"],
    ["algo.adv_estimator=prime", "algo.prime.acc_filter=false", "algo.mode=clip_cov",
     "algo.rollout_correction.bypass=true"],
], ids=["kl_cov+controller+lambda+dapo", "prime+clip_cov+bypass"])
def test_the_algorithms_keep_working_off_policy(tmp_path, over):
    run = train_mod.train(tiny(tmp_path, "run", "rollout.async=one_step", "trainer.max_steps=2",
                               "trainer.eval_every=0", *over))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["applied_steps"] > 0
    assert all(v is None or not isinstance(v, float) or v == v for r in rows for v in r.values())  # no NaN
    assert rows[-1]["async/staleness_max"] == 1
    assert "rollout_corr/rollout_is_mean" in rows[-1]  # the correction is on by default off-policy


@pytest.mark.slow
def test_lora_adapters_reach_the_engine_process(tmp_path):
    """After training, the engine's sampling log-probs of its own samples equal the trainer's for the same tokens;
    an engine that got the base but not the adapters is far off (so a lost adapter is caught)."""
    from fastcov.trainer.rollout.base import SamplingParams, sample_seed
    from fastcov.trainer.runtime.batch import Sequence
    from fastcov.trainer.runtime.lora import is_adapter_param

    seen = {}

    def on_end(policy, rollout):
        prompts = [[5, 6, 7, 8], [9, 10, 11]] * 2
        sampling = SamplingParams(1.0, 1.0, 8, seeds=[sample_seed(1, 99, i, 0) for i in range(len(prompts))])

        def gap(buckets):
            rollout.update_weights(buckets, version=99)
            out = rollout.generate(prompts, sampling)
            seqs = [Sequence(p, ids, lps, 0) for p, ids, lps in zip(prompts, out.token_ids, out.logprobs, strict=True)]
            train_mod.compute_old_logprobs(policy, seqs, cfg, 0, torch.device("cpu"))
            return max(abs(a - b) for s in seqs for a, b in zip(s.old_logprob, s.sample_logprob, strict=True))

        seen["adapter_bytes"] = sum(p.numel() * p.element_size() for p in policy.policy.lm.parameters()
                                    if p.requires_grad)
        seen["synced"] = gap(policy.weight_buckets(1.0, trainable_only=True))
        zeros = [(n, torch.zeros_like(t)) for b in policy.weight_buckets(1.0, trainable_only=True) for n, t in b
                 if is_adapter_param(n) and ".lora_B." in n]  # the adapters' B = 0: the base alone
        seen["base_only"] = gap(zeros)

    cfg = tiny(tmp_path, "lora", "rollout.async=one_step", "model.lora_rank=8", "model.lora_alpha=16",
               "optim.lr=0.05", "trainer.max_steps=3", "trainer.eval_every=0")
    run = train_mod.train(cfg, on_end=on_end)
    # after the first push (base and adapters) each step's push is the adapters alone
    assert [r["sync_bytes"] for r in read_metrics(run / "metrics.jsonl")] == [seen["adapter_bytes"]] * 3
    # fp32 on both sides: the engine's KV-cache decode and the trainer's fused full-sequence pass differ by rounding
    assert seen["synced"] < 1e-4, seen
    assert seen["base_only"] > 1e-2, seen  # the trained adapters move the log-probs by far more than that
