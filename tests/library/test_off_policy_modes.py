"""The two ways fastcov trains on another policy's samples, each against its formula on fresh random tensors
(float64 references: value and gradient), with the three policies of an asynchronous run: π (being trained),
π_old (the policy before this step: "proximal" in AReaL, recomputed by the trainer) and π_behav (the engine's own
sampling log-probs, possibly several versions older).

* decoupled (fastcov's default; verl's decoupled mode, AReaL's decoupled PPO):
  ℓ_t = w_t · max(−A_t r_t, −A_t clip(r_t, 1 − ε, 1 + ε)),  r_t = π/π_old,  w_t = π_old/π_behav truncated
  (TIS: min(w, C)) or masked (IcePop / AReaL's behav_imp_weight_cap: 0 above C), per token or per sequence;
* bypass (verl's bypass mode, ``algo.rollout_correction.bypass``): ℓ_t = max(−A_t r'_t, −A_t clip(r'_t)),
  r'_t = π/π_behav, no separate weight (the ratio holds it).
"""

from __future__ import annotations

import pytest
import torch

from fastcov.correction import rollout_correction
from fastcov.losses import LossConfig, policy_loss

EPS = 0.2


def tensors(seed: int, B=5, T=11):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.01
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # a few versions apart
    behav = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    return logp.clamp(max=-1e-3), old.clamp(max=-1e-3), behav.clamp(max=-1e-3), adv, mask


def ppo(logp, ref, adv):
    r = torch.exp(logp - ref)
    return torch.maximum(-adv * r, -adv * r.clamp(1 - EPS, 1 + EPS))


def token_mean(loss, mask):
    return (loss * mask).sum() / mask.sum()


def fastcov_loss(logp, ref, adv, mask, weights=None):
    loss, _ = policy_loss(logp, ref, adv, mask, mode="vanilla", agg="token-mean",
                          config=LossConfig(clip_low=EPS, clip_high=EPS), weights=weights)
    return loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level,mode,cap", [("token", "truncate", 2.0), ("token", "mask", 1.5),
                                            ("sequence", "truncate", 3.0), ("sequence", "mask", 5.0)])
def test_decoupled_is_the_weighted_clip_against_the_old_policy(seed, level, mode, cap):
    logp, old, behav, adv, mask = tensors(seed)
    w, _ = rollout_correction(old - behav, mask, level=level, mode=mode, clip_max=cap)
    x = logp.clone().requires_grad_(True)
    got = fastcov_loss(x, old, adv, mask, weights=w)
    (g_got,) = torch.autograd.grad(got, x)

    ratio = old - behav
    if level == "sequence":  # one weight per row: exp of the row's summed log-ratio (bounded exponent)
        ratio = (ratio * mask).sum(-1, keepdim=True).clamp(-20, 20).expand_as(ratio)
    raw = torch.exp(ratio)
    want_w = raw.clamp(max=cap) if mode == "truncate" else torch.where(raw <= cap, raw, torch.zeros_like(raw))
    assert torch.allclose(w[mask], want_w[mask], rtol=1e-12, atol=0)  # float64 throughout: rounding only
    y = logp.clone().requires_grad_(True)
    want = token_mean(want_w * ppo(y, old, adv), mask)
    (g_want,) = torch.autograd.grad(want, y)
    # float64 sums of ~40 terms of magnitude ~e^3: relative rounding well under 1e-12
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
    assert torch.allclose(g_got, g_want, rtol=1e-10, atol=1e-14)
    if mode == "mask":
        assert (w[mask] == 0).any() or (raw[mask] <= cap).all()  # a weight above the cap is dropped, not clamped


@pytest.mark.parametrize("seed", [3, 4])
def test_bypass_is_the_clip_against_the_behaviour_policy(seed):
    logp, old, behav, adv, mask = tensors(seed)
    x = logp.clone().requires_grad_(True)
    got = fastcov_loss(x, behav, adv, mask)  # what the trainer computes once old_logprob := the rollout's
    (g_got,) = torch.autograd.grad(got, x)
    y = logp.clone().requires_grad_(True)
    want = token_mean(ppo(y, behav, adv), mask)
    (g_want,) = torch.autograd.grad(want, y)
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
    assert torch.allclose(g_got, g_want, rtol=1e-10, atol=1e-14)
    # the two modes are different objectives as soon as π_old ≠ π_behav (they agree only on-policy)
    w, _ = rollout_correction(old - behav, mask, clip_max=1e6)
    decoupled = fastcov_loss(logp, old, adv, mask, weights=w)
    assert abs(decoupled.item() - got.item()) > 1e-3


def test_both_are_the_plain_clip_on_policy():
    logp, old, _, adv, mask = tensors(5)
    w, _ = rollout_correction(torch.zeros_like(old), mask)
    assert fastcov_loss(logp, old, adv, mask, weights=w).item() == pytest.approx(
        fastcov_loss(logp, old, adv, mask).item(), rel=1e-14)
