"""bench/tabular_dynamics.py: the GRPO simulator on a tabular softmax policy (κ of a sampled answer, GRPO
advantages, the update rules, whole runs of vanilla / Clip-Cov / KL-Cov), and bench/tabular_figure.py's command."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.tabular_dynamics import (
    DynamicsConfig,
    TabularProblem,
    _update,
    _vocab_cov,
    grpo_advantages,
    simulate,
)
from bench.tabular_figure import main
from fastcov.dynamics import logprob_covariance, policy_entropy
from fastcov.schedules import PositiveWeightSchedule

F64 = torch.float64


def _np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _random_policy(seed, rows=48, k=12, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(rows, k, generator=g, dtype=F64), g


def _relative_gap(pred, actual):
    return float(torch.linalg.vector_norm(pred - actual) / torch.linalg.vector_norm(actual))


def test_vocab_covariance_is_entropy_sensitivity_of_a_token_step():
    """κ_y = Cov(log π, e_y − π) (docs/design.md §3); a step Δz = η(e_y − π) changes H by ≈ −η·κ_y."""
    z, g = _random_policy(8, rows=16, k=9)
    y = torch.randint(0, 9, (16, 1), generator=g)
    kappa = _vocab_cov(torch.log_softmax(z, -1), y).squeeze(1)
    onehot = torch.zeros_like(z).scatter_(1, y, 1.0)
    direction = onehot - torch.softmax(z, -1)
    torch.testing.assert_close(kappa, logprob_covariance(z, direction), rtol=1e-10, atol=1e-13)
    eta = 1e-4
    actual = policy_entropy(z + eta * direction) - policy_entropy(z)
    assert _relative_gap(-eta * kappa, actual) < 1e-3




# ---------------------------------------------------------------------------------------- pieces
def test_grpo_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]], dtype=F64)
    a = grpo_advantages(r)
    row0 = (np.array([1, 0, 0, 1]) - 0.5) / (np.std([1, 0, 0, 1], ddof=1) + 1e-6)
    np.testing.assert_allclose(a[0].numpy(), row0, rtol=1e-12)
    assert torch.equal(a[1], torch.zeros(4, dtype=F64))
    assert abs(float(a[2].sum())) < 1e-12 and float(a[2, 3]) > 0
    with pytest.raises(ValueError, match="rewards must be"):
        grpo_advantages(torch.ones(3, 1, dtype=F64))


def test_tabular_problem_random():
    a = TabularProblem.random(20, 10, max_correct=4, seed=11)
    b = TabularProblem.random(20, 10, max_correct=4, seed=11)
    c = TabularProblem.random(20, 10, max_correct=4, seed=12)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.correct, b.correct)
    assert not torch.equal(a.logits, c.logits)
    counts = a.correct.sum(1)
    assert a.logits.dtype == F64 and int(counts.min()) >= 1 and int(counts.max()) <= 4
    acc = a.accuracy()
    expected = (_np_softmax(a.logits.numpy()) * a.correct.numpy()).sum(-1)
    np.testing.assert_allclose(acc.numpy(), expected, rtol=1e-12)
    with pytest.raises(ValueError, match="max_correct must be below n_answers"):
        TabularProblem.random(4, 5, max_correct=5)
    with pytest.raises(ValueError, match="n_prompts must be a positive int"):
        TabularProblem.random(0, 5)
    with pytest.raises(ValueError, match="correct must be a bool tensor"):
        TabularProblem(torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3))


def test_dynamics_config_validation():
    problem = TabularProblem.random(4, 6, max_correct=2, seed=0)
    for field, value, match in [("group_size", 1, "group_size must be at least 2"),
                                ("lr", 0.0, "lr must be a positive number"),
                                ("epochs", 0, "epochs must be a positive int"),
                                ("minibatches", 0, "minibatches must be a positive int"),
                                ("update", "adam", "update must be one of")]:
        with pytest.raises(ValueError, match=match):
            simulate(problem, DynamicsConfig(steps=1), **{field: value})


def _on_policy_update(update):
    """One _update with the real vanilla loss on a hand-made batch; returns (z, Δz, rows, cols, adv)."""
    g = torch.Generator().manual_seed(21)
    P, K, n = 5, 7, 6
    z = torch.randn(P, K, generator=g, dtype=F64)
    rows = torch.arange(P).repeat_interleave(n)
    cols = torch.randint(0, K, (P * n,), generator=g)
    adv = torch.randn(P * n, 1, generator=g, dtype=F64)
    old = torch.log_softmax(z, -1)[rows, cols].reshape(-1, 1)
    from fastcov.losses import LossConfig, policy_loss

    cfg = DynamicsConfig(update=update, lr=0.7, mode="vanilla")
    new_z, metrics = _update(z, torch.arange(P * n), rows, cols, old, adv, cfg, LossConfig(), policy_loss,
                             torch.Generator().manual_seed(0))
    return z, new_z - z, rows, cols, adv


def test_update_rules_on_policy():
    # vanilla PG: Δz_p = lr·P·(1/N)·Σ_{t∈p} A_t (e_{a_t} − π_p)  (token-mean loss, ratio 1, no clipping)
    z, delta, rows, cols, adv = _on_policy_update("vanilla")
    P, K = z.shape
    N = rows.numel()
    p = torch.softmax(z, -1)
    expected = torch.zeros_like(z)
    for t in range(N):
        e = torch.zeros(K, dtype=F64)
        e[cols[t]] = 1.0
        expected[rows[t]] += float(adv[t]) * (e - p[rows[t]])
    torch.testing.assert_close(delta, 0.7 * P / N * expected, rtol=1e-10, atol=1e-13)
    # natural PG: Δz[p, a] = lr · mean of A over that prompt's samples of a; 0 elsewhere
    z, delta, rows, cols, adv = _on_policy_update("natural")
    total = torch.zeros_like(z)
    count = torch.zeros_like(z)
    for t in range(N):
        total[rows[t], cols[t]] += float(adv[t])
        count[rows[t], cols[t]] += 1
    expected = torch.where(count > 0, 0.7 * total / count.clamp_min(1), torch.zeros_like(z))
    torch.testing.assert_close(delta, expected, rtol=1e-10, atol=1e-13)


# ------------------------------------------------------------------------------------- simulator
@pytest.fixture(scope="module")
def method_runs():
    """vanilla / clip_cov / kl_cov from the same start and seed, for two seeds (about 2 s per run)."""
    out = {}
    for seed in (0, 1):
        problem = TabularProblem.random(seed=seed)
        config = DynamicsConfig(steps=240, seed=seed)
        out[seed] = {mode: simulate(problem, config, mode=mode) for mode in ("vanilla", "clip_cov", "kl_cov")}
    return out


def test_vanilla_grpo_collapses_entropy(method_runs):
    for runs in method_runs.values():
        run = runs["vanilla"]
        assert run.entropy.shape == (241,) and run.accuracy.shape == (241,) and run.actual_dH.shape == (240,)
        assert run.entropy[0] > 3.0 and run.accuracy[0] < 0.15
        assert run.entropy[-1] < 0.15 * run.entropy[0]  # collapse
        assert run.accuracy[-1] > 0.9  # saturation
        tail = run.entropy[-60:]
        assert np.all(np.diff(tail) < 0.05)  # and it does not come back
        # Lemma 1 tracks the simulator's actual per-step entropy changes (first order, small steps)
        s = run.summary()
        assert s["lemma1_rel_error"] < 0.05
        np.testing.assert_allclose(run.entropy[1:] - run.entropy[:-1], run.actual_dH, atol=1e-12)


def test_clip_cov_and_kl_cov_keep_more_entropy(method_runs):
    for runs in method_runs.values():
        van = runs["vanilla"].summary()
        for mode in ("clip_cov", "kl_cov"):
            s = runs[mode].summary()
            assert s["entropy_mean"] > 1.08 * van["entropy_mean"], (mode, s, van)
            assert s["entropy_final"] > 1.05 * van["entropy_final"], (mode, s, van)
            assert s["entropy_at_accuracy_0.8"] > van["entropy_at_accuracy_0.8"], (mode, s, van)
            assert s["accuracy_final"] > 0.85  # still learns
            sel = runs[mode].metrics["selected_frac"]
            assert 0.0 < float(np.nanmean(sel)) <= 0.1 + 1e-12  # selection happened, within the ratio
        assert float(np.nanmax(runs["vanilla"].metrics["selected_frac"])) == 0.0


def test_same_start_and_seed_give_identical_first_batch(method_runs):
    runs = method_runs[0]
    for mode in ("clip_cov", "kl_cov"):
        assert runs[mode].entropy[0] == runs["vanilla"].entropy[0]
    rerun = simulate(TabularProblem.random(seed=0), DynamicsConfig(steps=5, seed=0), mode="vanilla")
    np.testing.assert_array_equal(rerun.entropy, method_runs[0]["vanilla"].entropy[:6])


def test_natural_pg_run_and_positive_weight_schedule():
    problem = TabularProblem.random(16, 12, max_correct=3, seed=3)
    sched = PositiveWeightSchedule("entropy", init=1.0, threshold=1.5, step_size=0.25)
    run = simulate(problem, DynamicsConfig(steps=40, seed=3, update="natural", lr=0.3, epochs=2, minibatches=2),
                   positive_weight=sched)
    assert run.entropy[-1] < run.entropy[0] and run.accuracy[-1] > run.accuracy[0]
    # λ used at each step follows docs/design.md §4's rule applied to the entropy after the previous step
    lam, expected = 1.0, []
    for h in run.entropy[1:]:
        expected.append(lam)
        lam = min(1.0, max(0.0, lam - 0.25 if h < 1.5 else lam + 0.25))
    np.testing.assert_allclose(run.positive_weight, expected)
    assert run.positive_weight.min() < 1.0  # the schedule acted
    assert sched.step_count == 40


def test_zero_positive_weight_never_raises_a_correct_answer():
    """λ = 0: only negative-advantage (wrong) answers get pushed down — the mass on correct answers can
    only grow through renormalisation, and no correct logit ever increases (natural PG, on-policy)."""
    problem = TabularProblem.random(8, 10, max_correct=3, seed=9)
    run = simulate(problem, DynamicsConfig(steps=15, seed=9, update="natural", lr=0.5, minibatches=1),
                   positive_weight=PositiveWeightSchedule("constant", init=0.0))
    moved = run.final_logits - problem.logits
    assert float(moved[problem.correct].max()) <= 1e-12
    assert float(moved[~problem.correct].min()) < -0.1


def test_cli_writes_figure(tmp_path, capsys):
    out = tmp_path / "dyn.png"
    assert main(["--steps", "8", "--prompts", "8", "--answers", "10", "--max-correct", "3", "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vanilla GRPO" in text and "Clip-Cov" in text and "KL-Cov" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
