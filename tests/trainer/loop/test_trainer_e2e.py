"""The training loop end to end on CPU: a tiny step, resume exactness, faults, the CLI."""

import json

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from _fixtures import TINY, stable, tiny

from fastcov.trainer import train as train_mod
from fastcov.trainer.rewards import RewardFn
from fastcov.trainer.runtime.run_dir import read_metrics

pytestmark = pytest.mark.usefixtures("varied_rewards")  # tests/trainer/conftest.py


def test_tiny_end_to_end_step(tmp_path):
    cfg = tiny(tmp_path, "run", "trainer.max_steps=2", "algo.mode=clip_cov")
    torch.set_num_threads(3)  # the caller's own count (the run pins trainer.threads=1 while it lasts)
    run = train_mod.train(cfg)
    assert torch.get_num_threads() == 3  # given back: a run in a caller's process leaves its thread count alone
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2]
    last = recs[-1]
    for key in ("entropy", "reward_mean", "val_acc", "cov_mean", "selected_frac", "clipfrac", "ppo_kl",
                "response_len", "lr", "time/rollout", "time/update", "tokens_per_s", "skipped_steps"):
        assert key in last, key
    assert last["entropy"] > 0 and last["applied_steps"] == 2 and last["skipped_steps"] == 0
    assert last["selected_frac"] > 0  # clip_cov picked tokens
    assert abs(last["rollout_logprob_diff"]) < 1e-4  # rollout sampling logprobs match the policy's
    assert (run / "config.yaml").is_file() and (run / "final" / "config.json").is_file()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]


def test_resume_gives_the_same_metrics(tmp_path):
    over = ["trainer.max_steps=4", "trainer.save_every=2", "algo.mode=clip_cov", "trainer.eval_every=2"]
    full = train_mod.train(tiny(tmp_path, "full", *over))
    cut = tiny(tmp_path, "cut", *over)
    train_mod.train(cut, stop_at=2)
    assert [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")] == [0, 1, 2]
    train_mod.train(cut, resume=True)
    a = stable(read_metrics(full / "metrics.jsonl"))
    b = stable(read_metrics(tmp_path / "cut" / "metrics.jsonl"))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert a == b
    assert a[-1]["grad_norm"] > 0  # the runs really trained
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


def test_non_finite_loss_skips_the_step(tmp_path, monkeypatch):
    real = train_mod.policy_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:  # one micro-batch of one mini-batch
            loss = loss * float("nan")
        return loss, metrics

    monkeypatch.setattr(train_mod, "policy_loss", poisoned)
    seen = {}

    def on_end(engine, rollout):
        seen["finite"] = all(bool(torch.isfinite(p).all()) for p in engine.policy.parameters())

    with pytest.warns(UserWarning, match="non-finite"):
        run = train_mod.train(tiny(tmp_path, "nan", "trainer.max_steps=3"), on_end=on_end)
    recs = read_metrics(run / "metrics.jsonl")
    assert recs[-1]["skipped_steps"] == 1
    assert sum(r["applied_steps"] for r in recs[1:]) == 3 * 2 - 1  # 3 steps x 2 mini-batches, one skipped
    assert seen["finite"]
    assert all(r["loss"] is not None for r in recs[1:])


def test_rollout_error_stops_with_a_clear_message(tmp_path, monkeypatch):
    from fastcov.trainer.rollout import HFRolloutEngine

    real = HFRolloutEngine.generate
    calls = {"n": 0}

    def flaky(self, prompts, sampling, generator=None):
        calls["n"] += 1
        if calls["n"] == 4:  # eval@0, step 1, eval... -> fails in step 2's rollout
            raise RuntimeError("CUDA error: out of memory (simulated)")
        return real(self, prompts, sampling, generator)

    monkeypatch.setattr(HFRolloutEngine, "generate", flaky)
    cfg = tiny(tmp_path, "err", "trainer.max_steps=3", "trainer.save_every=1", "trainer.eval_every=1")
    with pytest.raises(train_mod.RolloutError, match=r"step 2.*out of memory.*step_000001"):
        train_mod.train(cfg)
    ckpts = [p.name for p in (tmp_path / "err" / "checkpoints").iterdir()]
    assert ckpts == ["step_000001"]
    state = json.loads((tmp_path / "err" / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["step"] == 1


def test_cli_help_and_bad_config(capsys):
    from fastcov.cli import main

    for cmd in ("train", "eval", "report"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
    assert main(["train", str(TINY), "algo.mdoe=kl_cov"]) == 2
    assert "algo.mdoe" in capsys.readouterr().err
    assert main(["train", str(TINY), "algo.mode=kl_cov", "--print-config"]) == 0
    assert "mode: kl_cov" in capsys.readouterr().out


def _mostly_uniform_rewards(self, texts, truths):
    """A quarter of the prompts (by a hash of their answer) get rewards 0,1,0,1... over their group; the
    rest all 1: most groups have zero variance and DAPO's filter drops them."""
    import zlib

    out, seen = [], {}
    for truth in truths:
        k = seen.get(truth, 0)
        seen[truth] = k + 1
        out.append(float(k % 2) if zlib.crc32(str(truth).encode()) % 4 == 0 else 1.0)
    return out


@pytest.mark.parametrize("max_gen_batches", [0, 2])
def test_dapo_refill_fills_the_batch_with_informative_groups(tmp_path, monkeypatch, max_gen_batches):
    monkeypatch.setattr(RewardFn, "batch", _mostly_uniform_rewards)
    trained = []
    real_update = train_mod.update_policy

    def spy(engine, seqs, kept_groups, *args, **kwargs):
        by_group = {}
        for s in seqs:
            by_group.setdefault(s.group, []).append(s.reward)
        trained.append((sorted(kept_groups), by_group))
        return real_update(engine, seqs, kept_groups, *args, **kwargs)

    monkeypatch.setattr(train_mod, "update_policy", spy)
    cfg = tiny(tmp_path, "run", "trainer.max_steps=3", "trainer.eval_every=0", "algo.dapo_filter=true",
               f"algo.max_gen_batches={max_gen_batches}", "algo.mode=vanilla")
    run = train_mod.train(cfg)
    recs = read_metrics(run / "metrics.jsonl")
    assert len(recs) == 3 and len(trained) == 3
    for rec, (groups, by_group) in zip(recs, trained, strict=True):
        assert rec["kept_groups"] == len(groups) == len(by_group)
        for rewards in by_group.values():  # only groups with reward variance are trained on
            assert len(set(rewards)) > 1 and len(rewards) == cfg.rollout.n
        if max_gen_batches == 0:
            assert rec["kept_groups"] == cfg.trainer.prompts_per_step  # refilled until full
        else:
            assert rec["gen_batches"] <= 2 and rec["kept_groups"] <= cfg.trainer.prompts_per_step
    assert sum(r["gen_batches"] for r in recs) > len(recs), "a quarter of the groups survive: refills happen"
    assert recs[-1]["filtered_groups"] > 0


def test_refill_needs_the_dapo_filter(tmp_path):
    from fastcov.trainer.config import ConfigError

    with pytest.raises(ConfigError, match="algo.max_gen_batches"):
        tiny(tmp_path, "run", "algo.max_gen_batches=3")


def test_clip_cov_band_that_selects_nothing_warns_once_with_the_numbers(tmp_path):
    cfg = tiny(tmp_path, "run", "trainer.max_steps=2", "trainer.eval_every=0", "algo.mode=clip_cov",
               "algo.loss.clip_cov_lb=1000.0", "algo.loss.clip_cov_ub=2000.0")
    with pytest.warns(UserWarning, match=r"Clip-Cov selected no token: .*band \(1000, 2000\).*mean .*max ") as rec:
        run = train_mod.train(cfg)
    assert sum("Clip-Cov selected no token" in str(w.message) for w in rec) == 1
    assert read_metrics(run / "metrics.jsonl")[-1]["selected_frac"] == 0


def test_selection_diagnostics_are_logged(tmp_path):
    run = train_mod.train(tiny(tmp_path, "run", "trainer.max_steps=1", "trainer.eval_every=0", "algo.mode=kl_cov"))
    last = read_metrics(run / "metrics.jsonl")[-1]
    assert last["selected_frac"] > 0
    assert 0 <= last["sel/pos_adv_share"] <= 1 and 0 < last["sel/mean_prob"] <= 1
    assert last["sel/tokens_per_update"] >= 1 and "sel/mean_cov" in last
