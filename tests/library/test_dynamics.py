"""fastcov.dynamics: first-order entropy theory on tabular softmax policies (the GRPO simulator that runs it
over whole runs is bench/tabular_dynamics.py, tested in tests/benchmarks/test_tabular_dynamics.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastcov.dynamics import (
    logprob_covariance,
    policy_entropy,
    policy_gradient_step,
    predicted_entropy_change,
)

F64 = torch.float64


def _np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_entropy(z):
    p = _np_softmax(z)
    return -(p * np.log(p)).sum(-1)


def _np_cov_logp(z, v):
    """Cov_{a~π}(log π(a), v(a)) = E[log π · v] − E[log π]·E[v], row-wise, plain NumPy float64."""
    p = _np_softmax(z)
    lp = np.log(p)
    return (p * lp * v).sum(-1) - (p * lp).sum(-1) * (p * v).sum(-1)


def _random_policy(seed, rows=48, k=12, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(rows, k, generator=g, dtype=F64), g


def _relative_gap(pred, actual):
    return float(torch.linalg.vector_norm(pred - actual) / torch.linalg.vector_norm(actual))


# ------------------------------------------------------------------------------------------ theory
def test_entropy_and_covariance_match_numpy():
    z, g = _random_policy(1)
    v = torch.randn(z.shape, generator=g, dtype=F64)
    np.testing.assert_allclose(policy_entropy(z).numpy(), _np_entropy(z.numpy()), rtol=1e-12)
    np.testing.assert_allclose(logprob_covariance(z, v).numpy(), _np_cov_logp(z.numpy(), v.numpy()),
                               rtol=1e-9, atol=1e-12)
    # a one-hot-ish policy: entropy ≈ 0, no NaN
    sharp = torch.tensor([[50.0, 0.0, 0.0]], dtype=F64)
    assert 0.0 <= float(policy_entropy(sharp)) < 1e-18


def test_vanilla_step_is_the_autograd_gradient_of_expected_advantage():
    z, g = _random_policy(2)
    adv = torch.randn(z.shape, generator=g, dtype=F64)
    zl = z.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((torch.softmax(zl, -1) * adv).sum(), zl)
    torch.testing.assert_close(policy_gradient_step(z, adv, 0.3, update="vanilla"), 0.3 * grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(policy_gradient_step(z, adv, 0.3, update="natural"), 0.3 * adv)


def _check_first_order(z, step_fn, predict_fn, etas=(1e-1, 1e-2, 1e-3, 1e-4)):
    gaps = []
    for eta in etas:
        delta = step_fn(eta)
        actual = policy_entropy(z + delta) - policy_entropy(z)
        gaps.append(_relative_gap(predict_fn(eta, delta), actual))
    gaps = np.array(gaps)
    slope = np.polyfit(np.log(etas), np.log(gaps), 1)[0]
    assert 0.9 < slope < 1.1, (gaps, slope)  # the gap is O(η): relative error shrinks linearly
    for a, b in zip(gaps[:-1], gaps[1:], strict=True):
        assert 8.0 < a / b < 12.5, gaps  # η → η/10 divides the gap by ~10
    assert gaps[1] < 0.05 and gaps[2] <= 0.01 and gaps[3] <= 1e-3, gaps
    return gaps


@pytest.mark.parametrize("seed", [3, 4])
def test_lemma1_first_order_in_any_direction(seed):
    z, g = _random_policy(seed)
    direction = torch.randn(z.shape, generator=g, dtype=F64)
    _check_first_order(z, lambda eta: eta * direction, lambda eta, d: predicted_entropy_change(z, d))
    # the formula itself, independently: −Cov(log π, Δz)
    np.testing.assert_allclose(predicted_entropy_change(z, direction).numpy(),
                               -_np_cov_logp(z.numpy(), direction.numpy()), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("update", ["vanilla", "natural"])
def test_theorems_first_order_for_pg_and_npg(update):
    z, g = _random_policy(5 if update == "vanilla" else 6)
    q = (torch.rand(z.shape, generator=g, dtype=F64) < 0.3).to(F64)  # verifiable 0/1 rewards
    p = torch.softmax(z, -1)
    adv = q - (p * q).sum(-1, keepdim=True)  # A = Q − V, centred under π
    gaps = _check_first_order(
        z,
        lambda eta: policy_gradient_step(z, adv, eta, update=update),
        lambda eta, d: predicted_entropy_change(z, advantages=adv, lr=eta, update=update),
    )
    assert gaps[-1] < 1e-3
    eta = 0.05
    zn, pn, an = z.numpy(), p.numpy(), adv.numpy()
    expected = -eta * _np_cov_logp(zn, pn * an if update == "vanilla" else an)  # paper's formulas
    got = predicted_entropy_change(z, advantages=adv, lr=eta, update=update).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-13)


def test_theorem_forms_with_uncentred_advantages():
    z, g = _random_policy(7)
    adv = torch.randn(z.shape, generator=g, dtype=F64) + 3.0  # E_π[A] ≠ 0
    # NPG: a constant shift of A changes nothing (softmax shift invariance)
    torch.testing.assert_close(predicted_entropy_change(z, advantages=adv, lr=0.1, update="natural"),
                               predicted_entropy_change(z, advantages=adv - 3.0, lr=0.1, update="natural"))
    # PG: the implemented form is −η·Cov(log π, π(A − E_π A)) (the true gradient), not −η·Cov(log π, π·A)
    p = torch.softmax(z, -1).numpy()
    a = adv.numpy()
    centred = a - (p * a).sum(-1, keepdims=True)
    np.testing.assert_allclose(predicted_entropy_change(z, advantages=adv, lr=0.1, update="vanilla").numpy(),
                               -0.1 * _np_cov_logp(z.numpy(), p * centred), rtol=1e-9, atol=1e-13)
    assert not np.allclose(-0.1 * _np_cov_logp(z.numpy(), p * a), -0.1 * _np_cov_logp(z.numpy(), p * centred))


def test_theory_argument_errors():
    z = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="exactly one of delta_logits or advantages"):
        predicted_entropy_change(z)
    with pytest.raises(ValueError, match="exactly one of delta_logits or advantages"):
        predicted_entropy_change(z, z, advantages=z, lr=1.0)
    with pytest.raises(ValueError, match="lr is required"):
        predicted_entropy_change(z, advantages=z)
    with pytest.raises(ValueError, match="lr is only used with advantages"):
        predicted_entropy_change(z, z, lr=1.0)
    with pytest.raises(ValueError, match="update must be one of"):
        predicted_entropy_change(z, advantages=z, lr=1.0, update="adam")
    with pytest.raises(ValueError, match="values must have the shape of logits"):
        logprob_covariance(z, torch.zeros(2, 4, dtype=F64))
    with pytest.raises(TypeError, match="logits must be floating point"):
        policy_entropy(torch.zeros(2, 3, dtype=torch.int64))
