"""REINFORCE++ as published: token-level KL penalty in the reward, returns, batch-level normalisation;
a tiny CPU run; the recipe."""

import pathlib

import pytest
import torch

from fastcov import token_advantages as ta

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs"


def test_returns_match_a_loop():
    g = torch.Generator().manual_seed(0)
    B, T, beta = 5, 6, 0.1
    lengths = torch.tensor([6, 1, 3, 4, 2])
    mask = torch.arange(T)[None] < lengths[:, None]
    logp, ref = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    got, kl = ta.reinforce_pp_returns(outcome, logp, ref, mask, beta)
    for i in range(B):
        L = int(lengths[i])
        rewards = [-beta * float(logp[i, t] - ref[i, t]) for t in range(L)]
        rewards[-1] += float(outcome[i])
        for t in range(T):
            want = sum(rewards[t:]) if t < L else 0.0
            assert float(got[i, t]) == pytest.approx(want, abs=1e-6)
            assert float(kl[i, t]) == pytest.approx(float(logp[i, t] - ref[i, t]) if t < L else 0.0, abs=1e-6)
    k3 = ta.kl_penalty(logp, ref, mask, "k3")
    assert (k3[mask] >= 0).all()
    # no penalty: every token of a sequence carries its outcome
    flat, _ = ta.reinforce_pp_returns(outcome, logp, ref, mask, 0.0)
    assert torch.equal(flat, torch.where(mask, outcome[:, None].double(), 0.0))


def test_tiny_run_token_level_kl_and_batch_normalisation(tmp_path, monkeypatch, varied_rewards):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.run_dir import read_metrics

    seen = []
    real = train_mod.update_policy

    def spy(engine, seqs, *args, **kwargs):
        seen.append([list(s.token_advantages) for s in seqs])
        return real(engine, seqs, *args, **kwargs)

    monkeypatch.setattr(train_mod, "update_policy", spy)
    cfg = load_config("configs/tiny.yaml", [
        f"trainer.run_dir={tmp_path / 'rpp'}", "reward.sandbox=inline", "algo.adv_estimator=reinforce_pp",
        "algo.kl_coef=0.5", "algo.mode=vanilla", "trainer.max_steps=2", "trainer.eval_every=0",
        "optim.lr=1e-2"])
    run = train_mod.train(cfg)
    recs = read_metrics(run / "metrics.jsonl")
    assert recs[0]["kl_ref"] == pytest.approx(0.0, abs=1e-5)  # step 1: the policy is the reference
    assert abs(recs[1]["kl_ref"]) > 1e-4  # step 2: it moved
    for step_adv in seen:
        flat = torch.tensor([a for s in step_adv for a in s], dtype=torch.float64)
        assert float(flat.mean()) == pytest.approx(0.0, abs=1e-5)  # normalised over the batch's tokens
        assert float(flat.std()) == pytest.approx(1.0, abs=1e-4)
    # with the KL penalty, the advantages vary along a sequence at step 2
    assert any(len(set(round(a, 6) for a in s)) > 1 for s in seen[1] if len(s) > 1)


def test_recipe():
    from fastcov.trainer.config import load_config

    cfg = load_config(CONFIGS / "qwen2.5-7b-reinforce-pp.yaml", ["model.path=/m"])
    assert cfg.algo.adv_estimator == "reinforce_pp" and cfg.algo.kl_coef > 0
    assert (cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.algo.mini_batches) == (256, 8, 8)
    cfg = load_config(CONFIGS / "qwen2.5-0.5b-prime.yaml", ["model.path=/m"])
    p = cfg.algo.prime
    assert cfg.algo.adv_estimator == "prime" and (p.beta, p.lr, p.acc_low, p.acc_high) == (0.05, 1e-6, 0.2, 0.8)


def test_zero3_reference_is_the_gathered_starting_policy(tmp_path, varied_rewards):
    """Under ZeRO-3 the policy is created partitioned; the reference must still be the full starting
    weights: the first step's KL to it is exactly 0."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.run_dir import read_metrics

    cfg = load_config("configs/tiny.yaml", [
        f"trainer.run_dir={tmp_path / 'z3'}", "reward.sandbox=inline", "algo.adv_estimator=reinforce_pp",
        "algo.kl_coef=0.5", "algo.mode=vanilla", "trainer.max_steps=1", "trainer.eval_every=0",
        "trainer.zero_stage=3", "algo.mini_batches=1"])
    rec = read_metrics(train_mod.train(cfg) / "metrics.jsonl")[-1]
    assert rec["kl_ref"] == 0.0 and rec["applied_steps"] == 1
