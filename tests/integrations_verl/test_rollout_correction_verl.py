"""fastcov.correction and the CISPO / GSPO / SAPO modes against verl 0.9.1's own code (make test-verl).

The rollout correction (importance weights truncated or masked, token and sequence level), the rejection
criteria (every option of ``SUPPORTED_ROLLOUT_RS_OPTIONS``, alone and chained) and the off-policy metrics are
compared with ``verl/trainer/ppo/rollout_corr_helper.py`` on fresh random batches with odd shapes, padding
anywhere and an empty row; the three modes with verl's ``compute_policy_loss_{cispo,gspo,sapo}`` (values and
gradients), with and without rollout weights.
"""

import math

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is installed only in .venv-verl (make test-verl)")
helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from fastcov.correction import (  # noqa: E402
    REJECTION_CRITERIA,
    mismatch_metrics,
    rollout_correction,
    rollout_rejection,
)
from fastcov.losses import LossConfig, policy_loss  # noqa: E402

RTOL = 1e-6


def _batch(seed: int, rows: int = 11, cols: int = 29, scale: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=g) < 0.75  # holes anywhere, not only right padding
    mask[1] = False  # a row without valid tokens
    mask[2, :] = False
    mask[2, 3] = True  # a row with one token
    old = -3.0 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    rollout = old - scale * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    rollout[~mask] = float("nan")  # padding holds garbage
    return old, rollout, mask


def _close(ours: dict, theirs: dict, prefix: str = ""):
    missing = [k for k in theirs if k.removeprefix(prefix) not in ours]
    assert not missing, f"verl reports metrics fastcov does not: {missing}"
    for key, value in theirs.items():
        mine = float(ours[key.removeprefix(prefix)])
        assert math.isclose(mine, float(value), rel_tol=RTOL, abs_tol=1e-9), (key, mine, value)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.05, "0.9_1.1", "0.5_3.0"])
def test_importance_weights_match_verl(seed, level, threshold):
    old, rollout, mask = _batch(seed, scale=0.05 if level == "sequence" else 0.2)
    log_ratio = old - torch.nan_to_num(rollout)
    theirs_w, theirs_m = helper.compute_rollout_correction_weights(
        log_ratio * mask, mask.to(old.dtype), rollout_is=level, rollout_is_threshold=threshold
    )
    if isinstance(threshold, str):
        lo, hi = (float(x) for x in threshold.split("_"))
        ours_w, ours_m = rollout_correction(log_ratio, mask, level=level, mode="mask", clip_max=hi, clip_min=lo)
    else:
        ours_w, ours_m = rollout_correction(log_ratio, mask, level=level, mode="truncate", clip_max=threshold)
    torch.testing.assert_close(ours_w, theirs_w, rtol=RTOL, atol=0.0)
    assert not ours_w.requires_grad and bool((ours_w[~mask] == 0).all())
    _close(ours_m, theirs_m)
    # the weights change something (the test could fail)
    assert float((ours_w[mask] - 1.0).abs().max()) > 1e-3


def test_sequence_weights_are_bounded_like_verl():
    old, rollout, mask = _batch(5, scale=3.0)  # sequence sums far beyond ±20
    log_ratio = old - torch.nan_to_num(rollout)
    theirs, _ = helper.compute_rollout_correction_weights(log_ratio * mask, mask.double(), "sequence", "1e-12_1e12")
    ours, _ = rollout_correction(log_ratio, mask, level="sequence", mode="mask", clip_max=1e12, clip_min=1e-12)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0.0)
    assert float(ours.max()) == pytest.approx(math.exp(20.0))


def test_std_of_a_constant_statistic_is_verls_but_for_its_epsilon():
    """verl's ``*_std`` (rollout_is_std, the rejection criteria's ``<prefix>_std``) is √(E[x²] − E[x]²) with its
    masked_mean's denominator n + 1e-8: for a constant x = μ over n tokens that is |μ|·√(f(1 − f)), f = n / (n + 1e-8),
    ≈ |μ|·1e-4/√n (4e-5 for μ = 1, n = 6), where fastcov's exact means give 0. Nowhere else do the two part by more
    than 1e-6 (the other tests); docs/integrations.md states this."""
    old, rollout, mask = _batch(9)
    n = int(mask.sum())
    f = n / (n + 1e-8)
    # every sequence's ratio above the bound: each token's weight is the bound, 1.05
    log_ratio = torch.full_like(old, 0.5)
    _, theirs = helper.compute_rollout_correction_weights(log_ratio * mask, mask.double(), rollout_is="sequence",
                                                          rollout_is_threshold=1.05)
    _, ours = rollout_correction(log_ratio, mask, level="sequence", mode="truncate", clip_max=1.05)
    assert float(ours["rollout_is_std"]) == 0.0
    assert theirs["rollout_is_std"] == pytest.approx(1.05 * math.sqrt(f * (1 - f)), rel=1e-3)
    # a rejection statistic constant on every token (k3 of one log-ratio, inside the bound: nothing rejected)
    log_ratio = torch.full_like(old, 0.1)
    keep_theirs, theirs = helper.compute_rollout_rejection_mask(log_ratio, mask.double(), "token_k3", 0.02)
    keep, ours = rollout_rejection(log_ratio, mask, "token_k3", 0.02)
    assert torch.equal(keep, keep_theirs.bool()) and bool(keep[mask].all())
    k3 = math.exp(0.1) - 1.0 - 0.1
    std_keys = [key for key in theirs if key.endswith("_std") and not key.endswith("_seq_std")]
    assert std_keys
    for key in std_keys:
        assert float(ours[key]) == 0.0, key
        assert theirs[key] == pytest.approx(k3 * math.sqrt(f * (1 - f)), rel=1e-3), key


def _criteria_cases():
    single = [(c, "1.5" if c.endswith("k1") else "0.02") for c in REJECTION_CRITERIA]
    chained = [("token_k1,seq_mean_k3,seq_max_k2", "0.7_1.4,0.01,0.05"), ("seq_sum_k1,token_k3", "0.5_2.0,0.03"),
               ("seq_sum_k2,seq_mean_k1", "0.2,1.5")]
    return single + chained


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("criteria,thresholds", _criteria_cases())
def test_rejection_matches_verl(seed, criteria, thresholds):
    old, rollout, mask = _batch(seed)
    log_ratio = old - torch.nan_to_num(rollout)
    theirs_mask, theirs_m = helper.compute_rollout_rejection_mask(log_ratio, mask.double(), criteria, thresholds)
    keep, ours_m = rollout_rejection(log_ratio, mask, criteria, thresholds)
    assert torch.equal(keep, theirs_mask.bool())
    _close(ours_m, theirs_m)
    assert 0 < int(keep.sum()) < int(mask.sum()) or criteria.startswith("seq"), "nothing rejected: a dead test"


def test_a_single_k1_bound_below_one_is_refused_as_verl_refuses_it():
    old, rollout, mask = _batch(0)
    with pytest.raises(ValueError):
        helper.compute_rollout_rejection_mask(old - old, mask.double(), "token_k1", 0.5)
    with pytest.raises(ValueError, match="thresholds: '0.5' for token_k1 has lo > hi"):
        rollout_rejection(old - old, mask, "token_k1", 0.5)


def test_the_criteria_are_verls():
    assert set(REJECTION_CRITERIA) == helper.SUPPORTED_ROLLOUT_RS_OPTIONS


@pytest.mark.parametrize("seed", [6, 7, 8])
def test_mismatch_metrics_match_verl(seed):
    old, rollout, mask = _batch(seed)
    theirs = helper.compute_offpolicy_metrics(old * mask, torch.nan_to_num(rollout) * mask, mask.double())
    _close(mismatch_metrics(old, rollout, mask), theirs)
    # and the whole pipeline: weights + rejection + metrics, with verl's "rollout_corr/" names
    _, theirs_mask, theirs_all = helper.compute_rollout_correction_and_rejection_mask(
        old * mask, torch.nan_to_num(rollout) * mask, mask.double(), rollout_is="token", rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01,
    )
    log_ratio = old - torch.nan_to_num(rollout)
    ours = {**rollout_correction(log_ratio, mask)[1], **rollout_rejection(log_ratio, mask, "seq_mean_k3", 0.01)[1],
            **mismatch_metrics(old, rollout, mask)}
    _close(ours, theirs_all, prefix="rollout_corr/")


# ---------------------------------------------------------------- CISPO / GSPO / SAPO against verl's losses


def _loss_batch(seed, rows=7, cols=23):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    logprob = -2.0 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old = logprob + 0.4 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, cols).clone() * mask
    weights = (0.5 + torch.rand(rows, cols, generator=g, dtype=torch.float64)) * mask
    return logprob, old, adv, mask, weights


def _actor_config(mode, agg, clip_low=0.2, clip_high=0.28, tau_pos=1.0, tau_neg=1.05):
    return ActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, use_dynamic_bsz=False,
        clip_ratio=clip_low, clip_ratio_low=clip_low, clip_ratio_high=clip_high, loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=mode), tau_pos=tau_pos, tau_neg=tau_neg,
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["cispo", "gspo", "sapo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_modes_match_verl(seed, mode, agg, with_weights):
    if mode == "sapo" and agg != "seq-mean-token-mean":
        pytest.skip("verl's SAPO always aggregates seq-mean-token-mean")
    logprob, old, adv, mask, weights = _loss_batch(seed)
    actor = _actor_config(mode, agg, tau_pos=1.3, tau_neg=2.1)
    config = LossConfig(clip_low=0.2, clip_high=0.28, cispo_clip_min=0.8, cispo_clip_max=1.28,
                        sapo_tau_pos=1.3, sapo_tau_neg=2.1)
    lp_theirs = logprob.clone().requires_grad_(True)
    theirs, _ = core_algos.get_policy_loss_fn(mode)(
        old, lp_theirs, adv, mask.double(), loss_agg_mode=agg, config=actor,
        rollout_is_weights=weights if with_weights else None,
    )
    theirs.backward()
    lp_ours = logprob.clone().requires_grad_(True)
    ours, _ = policy_loss(lp_ours, old, adv, mask, mode=mode, agg=agg, config=config,
                          weights=weights if with_weights else None)
    ours.backward()
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0.0)
    torch.testing.assert_close(lp_ours.grad, lp_theirs.grad, rtol=RTOL, atol=1e-12)
    assert float(lp_ours.grad.abs().sum()) > 0
