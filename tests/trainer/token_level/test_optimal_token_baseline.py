"""Optimal Token Baseline (algo.adv_estimator=optimal_token_baseline): the library function against a plain loop
over groups written from its definition (verl's own function is compared in tests/integrations_verl/), and a tiny
CPU run whose step-4 pass gives the old log-probs and Σπ² the advantages are built from."""

from __future__ import annotations

import pytest
import torch

from fastcov import token_advantages as ta


def _loop_otb(rewards, mask, groups, logp, sum_p2, weights=None, zero_tail=False, eps=1e-8):
    """OTB from its definition, one group and one position at a time, in float64."""
    B, T = rewards.shape
    m = mask.double()
    returns = torch.zeros(B, T, dtype=torch.float64)
    energy = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            returns[i, t] = sum(float(rewards[i, s] * m[i, s]) for s in range(t, T))
            energy[i, t] = sum(float((1 - 2 * logp[i, s].double().exp() + sum_p2[i, s])
                                     * (1.0 if weights is None else float(weights[i, s]) ** 2) * m[i, s])
                               for s in range(t + 1))
    baseline = torch.zeros(B, T, dtype=torch.float64)
    for g in torch.unique(groups).tolist():
        members = [i for i in range(B) if int(groups[i]) == g]
        if len(members) == 1:
            continue
        for t in range(T):
            num = sum(float(returns[i, t] * energy[i, t] * m[i, t]) for i in members)
            den = sum(float(energy[i, t] * m[i, t]) for i in members) + eps
            for i in members:
                baseline[i, t] = num / den
        if zero_tail:
            lengths = sorted(int(mask[i].sum()) for i in members)
            longest = [i for i in members if int(mask[i].sum()) == lengths[-1]]
            if len(longest) == 1 and lengths[-1] > lengths[-2]:
                baseline[longest[0], lengths[-2]:] = 0.0
    return (returns - baseline) * m, returns


def _batch(seed, B=9, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 2  # a unique longest row in group 0 (the zero tail), a short one
    mask = torch.arange(T)[None] < lengths[:, None]
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randn(B, generator=g)  # an outcome at the last token
    logp = -torch.rand(B, T, generator=g) * 3
    p2 = torch.rand(B, T, generator=g) * 0.5 + 0.05
    weights = torch.rand(B, T, generator=g) + 0.5
    groups = torch.tensor([7, 7, 7, 3, 3, 11, 3, 7, 5])[:B]  # unordered ids, a group of one (11), ragged sizes
    return rewards, mask, groups, logp, p2, weights


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_otb_equals_its_definition(seed, with_weights, zero_tail):
    rewards, mask, groups, logp, p2, weights = _batch(seed)
    w = weights if with_weights else None
    adv, ret = ta.optimal_token_baseline(rewards, mask, groups, logp, p2, w, handle_zero_tail=zero_tail)
    want_adv, want_ret = _loop_otb(rewards, mask, groups, logp, p2, w, zero_tail)
    # float64 inside, float32 out: one rounding of values near 1
    torch.testing.assert_close(adv.double(), want_adv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret.double(), want_ret, atol=1e-6, rtol=1e-6)
    assert torch.all(adv[~mask] == 0)
    assert torch.equal(adv[5], ret[5] * mask[5])  # the group of one keeps its returns (no baseline)


def test_otb_int_groups_are_contiguous_groups_and_bad_shapes_are_refused():
    rewards, mask, _, logp, p2, _ = _batch(4, B=6)
    by_n, _ = ta.optimal_token_baseline(rewards, mask, 3, logp, p2)
    by_id, _ = ta.optimal_token_baseline(rewards, mask, torch.tensor([0, 0, 0, 1, 1, 1]), logp, p2)
    assert torch.equal(by_n, by_id)
    with pytest.raises(ValueError, match="sum_p2"):
        ta.optimal_token_baseline(rewards, mask, 3, logp, p2[:, :-1])


def test_tiny_run_builds_otb_from_the_fused_pass(tmp_path, monkeypatch):
    """A 2-step run: the advantages the update sees are OTB of what step 4 stored (π and Σπ² of one fused pass at
    the rollout's temperature, which each sequence records), and Σπ² is a probability mass in [1/V, 1]."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config
    from fastcov.trainer.rewards import RewardFn
    from fastcov.trainer.runtime.run_dir import read_metrics

    monkeypatch.setattr(RewardFn, "__call__", lambda self, text, truth: float(len(text) % 3))
    seen = []
    real = train_mod.update_policy

    def spy(engine, seqs, *args, **kwargs):
        seen.append([(list(s.token_advantages), list(s.old_logprob), list(s.old_sum_p2), s.reward, s.group,
                      s.temperature) for s in seqs])
        return real(engine, seqs, *args, **kwargs)

    monkeypatch.setattr(train_mod, "update_policy", spy)
    cfg = load_config("configs/tiny.yaml", [
        f"trainer.run_dir={tmp_path / 'otb'}", "reward.sandbox=inline", "algo.adv_estimator=optimal_token_baseline",
        "algo.mode=vanilla", "trainer.max_steps=2", "trainer.eval_every=0", "rollout.temperature=0.8"])
    run = train_mod.train(cfg)
    recs = read_metrics(run / "metrics.jsonl")
    for rec in recs:
        assert 0 < rec["sum_p2"] <= 1 and rec["otb_energy"] >= 0
    for step in seen:
        width = max(len(s[0]) for s in step)
        mask = torch.tensor([[t < len(s[0]) for t in range(width)] for s in step])
        pad = lambda rows, width=width: torch.tensor([r + [0.0] * (width - len(r)) for r in rows])  # noqa: E731
        rewards = torch.zeros(len(step), width)
        for i, s in enumerate(step):
            rewards[i, len(s[0]) - 1] = s[3]
        want, _ = ta.optimal_token_baseline(rewards, mask, torch.tensor([s[4] for s in step]), pad([s[1] for s in step]),
                                            pad([s[2] for s in step]))
        torch.testing.assert_close(pad([s[0] for s in step]), want, atol=1e-6, rtol=1e-6)
        p2 = pad([s[2] for s in step])[mask]
        assert torch.all(p2 <= 1.0) and torch.all(p2 > 0)
        assert all(s[5] == 0.8 for s in step)
    # the baseline is not the group mean: advantages vary along a sequence
    assert any(len({round(a, 6) for a in s[0]}) > 1 for s in seen[0] if len(s[0]) > 1)
