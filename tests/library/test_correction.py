"""Rollout correction (fastcov/correction.py) and the CISPO / GSPO / SAPO modes (fastcov/policy_modes.py).

Exactness against verl 0.9.1's own helper and losses is tests/integrations_verl/test_rollout_correction_verl.py
(make test-verl); here: TRL's own off-policy mask and loss code, the formulas on odd shapes with garbage
padding, gradients, bad inputs, and what the weights do to Clip-Cov/KL-Cov's selection (nothing).
"""

import math
from types import SimpleNamespace

import pytest
import torch

import fastcov
from fastcov.correction import mismatch_metrics, off_policy_sequence_mask, rollout_correction, rollout_rejection
from fastcov.losses import LossConfig, policy_loss


def _batch(seed=0, rows=6, cols=13, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    log_ratio = scale * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    log_ratio[~mask] = float("nan")  # padding holds garbage
    return log_ratio, mask


def _reference_weights(log_ratio, mask, level, mode, hi, lo):
    """TRL's formula (grpo_trainer: per-token diff × mask, summed for sequence_*, exp, clamp or mask), row by row."""
    out = torch.zeros_like(log_ratio)
    for i in range(log_ratio.shape[0]):
        valid = mask[i]
        if level == "sequence":
            value = math.exp(float(log_ratio[i][valid].sum()))
            values = torch.full((int(valid.sum()),), value, dtype=log_ratio.dtype)
        else:
            values = log_ratio[i][valid].exp()
        if mode == "truncate":
            values = values.clamp(min=lo, max=hi)
        else:
            values = torch.where((values < (lo or -math.inf)) | (values > hi), 0.0, values)
        out[i][valid] = values
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("lo", [None, 0.8])
def test_weights_are_the_formula_with_zero_padding_and_no_gradient(level, mode, lo):
    log_ratio, mask = _batch(1, scale=0.3 if level == "token" else 0.08)
    log_ratio.requires_grad_(True)
    weights, metrics = rollout_correction(log_ratio, mask, level=level, mode=mode, clip_max=1.25, clip_min=lo)
    expected = _reference_weights(log_ratio.detach(), mask, level, mode, 1.25, lo)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=0.0)
    assert not weights.requires_grad and weights.dtype == torch.float64 and bool((weights[~mask] == 0).all())
    assert all(torch.isfinite(v) and v.dim() == 0 for v in metrics.values())
    assert float((weights[mask] - 1).abs().max()) > 0.1  # something is truncated or masked


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("lo", [None, 0.8])
def test_no_upper_bound_is_none_and_holds_in_every_dtype(level, mode, lo):
    """clip_max=None (TRL's ``vllm_importance_sampling_clip_max=None``) bounds nothing from above; so does a bound past
    the dtype's range (1e300 in fp32 used to raise 'value cannot be converted to type float without overflow')."""
    log_ratio, mask = _batch(4, scale=0.3 if level == "token" else 0.08)
    expected = _reference_weights(log_ratio, mask, level, mode, math.inf, lo)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for hi in (None, 1e300):
            weights, metrics = rollout_correction(log_ratio.to(dtype), mask, level=level, mode=mode, clip_max=hi,
                                                  clip_min=lo)
            # the reference in float64 from the same rounded inputs: exp of a rounded value, rounded once more
            reference = _reference_weights(log_ratio.to(dtype).double(), mask, level, mode, math.inf, lo)
            tol = 4 * torch.finfo(dtype).eps * (1 + 13 * (level == "sequence"))  # exp's rounding, × the summed terms
            torch.testing.assert_close(weights.double(), reference, rtol=tol, atol=0.0)
            assert weights.dtype == dtype and all(bool(torch.isfinite(v)) for v in metrics.values())
            assert float(metrics["rollout_is_ratio_fraction_high"]) == 0.0
            if lo is None:
                assert float(metrics["rollout_is_ratio_fraction_low"]) == 0.0
    assert float(expected[mask].max()) > 1.15  # ratios above any bound one would set are kept
    if lo is not None and level == "token":
        assert float(expected[mask].min()) in ((0.0,) if mode == "mask" else (lo,))  # the lower bound acts


def test_sequence_weights_broadcast_and_bound_the_exponent():
    log_ratio, mask = _batch(2, scale=5.0)
    weights, _ = rollout_correction(log_ratio, mask, level="sequence", mode="mask", clip_max=1e30)
    for i in range(mask.shape[0]):
        row = weights[i][mask[i]]
        assert bool((row == row[0]).all())
    assert float(weights.max()) <= math.exp(20.0) * (1 + 1e-12) and float(weights[mask].min()) >= math.exp(-20) * 0.99


@pytest.mark.parametrize("call, match", [
    (lambda lr, m: rollout_correction(lr[0], m[0]), r"log_ratio must be \[B, T\]"),
    (lambda lr, m: rollout_correction(lr.long(), m), "log_ratio must be a floating tensor"),
    (lambda lr, m: rollout_correction(lr, m[:, :3]), "mask must have log_ratio's shape"),
    (lambda lr, m: rollout_correction(lr, torch.zeros_like(m)), "mask has no valid token"),
    (lambda lr, m: rollout_correction(lr.masked_fill(m, math.inf), m), "log_ratio must be finite on valid tokens"),
    (lambda lr, m: rollout_correction(lr, m, clip_max=0.0), "clip_max must be a ratio > 0"),
    (lambda lr, m: rollout_correction(lr, m, clip_min=-1.0), "clip_min must be a ratio > 0"),
    (lambda lr, m: rollout_correction(lr, m, clip_max=1.5, clip_min=2.0), "clip_min must be ≤ clip_max"),
    (lambda lr, m: rollout_correction(lr, m, level="seq"), "level must be one of"),
    (lambda lr, m: rollout_correction(lr, m, mode="clip"), "mode must be one of"),
    (lambda lr, m: rollout_rejection(lr, m, "token_k4", 2.0), "criteria: unknown 'token_k4'"),
    (lambda lr, m: rollout_rejection(lr, m, "seq_max_k1", 2.0), "criteria: unknown 'seq_max_k1'"),
    (lambda lr, m: rollout_rejection(lr, m, "token_k2", "0.1_0.2"), "thresholds: '0.1_0.2' for token_k2"),
    (lambda lr, m: rollout_rejection(lr, m, "token_k1,token_k2", "1,2,3"), "thresholds: give one for all"),
    (lambda lr, m: rollout_rejection(lr, m, "token_k3", -1.0), "thresholds: '-1.0' for token_k3"),
    (lambda lr, m: off_policy_sequence_mask(lr, torch.zeros(2), m, 0.1), "advantages must be"),
    (lambda lr, m: off_policy_sequence_mask(lr, torch.zeros(lr.shape[0]), m, -0.1), "threshold must be"),
    (lambda lr, m: mismatch_metrics(lr, lr.float(), m), "rollout_logprob must have old_logprob's dtype"),
])
def test_bad_input_is_one_line_naming_the_argument(call, match):
    log_ratio, mask = _batch(3)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        call(log_ratio, mask)
    assert "\n" not in str(info.value)


def test_rejection_chains_criteria_and_drops_whole_sequences():
    log_ratio, mask = _batch(4)
    token, _ = rollout_rejection(log_ratio, mask, "token_k1", 1.2)
    clean = torch.nan_to_num(log_ratio)
    torch.testing.assert_close(token, mask & (clean.abs() <= math.log(1.2)))
    seq, metrics = rollout_rejection(log_ratio, mask, "seq_mean_k3", 0.02)
    rows = seq.any(-1)
    assert bool((seq == (mask & rows[:, None])).all()) and 0 < int(rows.sum()) < mask.shape[0]
    both, _ = rollout_rejection(log_ratio, mask, "token_k1,seq_mean_k3", "1.2,0.02")
    assert torch.equal(both, token & seq)
    assert float(metrics["rollout_rs_masked_fraction"]) == pytest.approx(1 - int(seq.sum()) / int(mask.sum()))


def test_off_policy_mask_is_trls():
    trl = pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    g = torch.Generator().manual_seed(5)
    rows, cols = 9, 11
    mask = (torch.arange(cols)[None, :] < torch.randint(1, cols + 1, (rows,), generator=g)[:, None])
    logps = -2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    sampling = logps + 0.2 * torch.randn(rows, cols, generator=g, dtype=torch.float64) + 0.05
    advantages = torch.randn(rows, 1, generator=g, dtype=torch.float64)
    assert trl.__version__.startswith("1.")
    for delta in (0.0, 0.03, 0.08):
        theirs = GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask.double(), delta)  # [B, 1]
        ours, _ = off_policy_sequence_mask(logps - sampling, advantages[:, 0], mask, delta)
        assert torch.equal(ours, mask & theirs.bool().expand(rows, cols))
    assert 0 < int(ours.sum()) < int(mask.sum())


def test_mismatch_metrics_are_zero_for_a_perfect_rollout():
    log_ratio, mask = _batch(6)
    logprob = -torch.rand(mask.shape, dtype=torch.float64)
    m = mismatch_metrics(logprob, logprob.clone(), mask)
    for k in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert float(m[k]) == pytest.approx(0.0, abs=1e-12), k
    assert float(m["ppl_ratio"]) == pytest.approx(1.0)


# ---------------------------------------------------------------- the weights in policy_loss


def _loss_inputs(seed=7, rows=5, cols=17):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(cols)[None, :] < torch.randint(2, cols + 1, (rows,), generator=g)[:, None]
    logprob = -2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old = logprob + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = (torch.randn(rows, 1, generator=g, dtype=torch.float64) + 0.3 * torch.randn(rows, cols, generator=g,
                                                                                       dtype=torch.float64)) * mask
    weights = (0.2 + 2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)) * mask
    return logprob, old, adv, mask, weights


@pytest.mark.parametrize("mode", ["vanilla", "clip_cov", "kl_cov", "cispo", "sapo", "gspo"])
def test_weights_multiply_the_per_token_gradient_and_leave_the_selection(mode):
    logprob, old, adv, mask, weights = _loss_inputs()
    config = LossConfig(clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0, kl_cov_ratio=0.2)
    grads, metrics = [], []
    for w in (None, weights):
        lp = logprob.clone().requires_grad_(True)
        gen = torch.Generator().manual_seed(0)
        loss, m = policy_loss(lp, old, adv, mask, mode=mode, config=config, generator=gen, weights=w)
        loss.backward()
        grads.append(lp.grad)
        metrics.append(m)
    assert float(metrics[0]["selected_frac"]) == float(metrics[1]["selected_frac"])
    torch.testing.assert_close(grads[1], grads[0] * weights, rtol=1e-12, atol=1e-15)
    if mode == "clip_cov":  # the detached tokens are the same ones
        assert torch.equal(grads[0] == 0, grads[1] == 0)
        assert int(((grads[0] == 0) & mask).sum()) > 0


def test_weights_bad_input():
    logprob, old, adv, mask, weights = _loss_inputs()
    with pytest.raises(ValueError, match="weights must have logprob's shape"):
        policy_loss(logprob, old, adv, mask, mode="vanilla", weights=weights[:, :3])
    with pytest.raises(TypeError, match="weights must be a floating tensor"):
        policy_loss(logprob, old, adv, mask, mode="vanilla", weights=mask)


# ---------------------------------------------------------------- CISPO / GSPO / SAPO


def test_modes_are_registered():
    assert {"cispo", "gspo", "sapo", "cispo_seq", "sapo_seq", "vespo"} <= set(fastcov.available_modes())


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage():
    logprob, old, adv, mask, _ = _loss_inputs(8)
    config = LossConfig(cispo_clip_max=1.2, cispo_clip_min=0.9)
    lp = logprob.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, mode="cispo", config=config)
    loss.backward()
    weight = (logprob - old).exp().clamp(0.9, 1.2)
    torch.testing.assert_close(lp.grad, -weight * adv * mask / mask.sum(), rtol=1e-12, atol=1e-15)


def test_gspo_ratio_is_the_sequence_mean_and_equals_vanilla_when_every_ratio_is_the_same():
    logprob, old, adv, mask, _ = _loss_inputs(9)
    old_same = logprob - 0.1  # every token's log-ratio 0.1: s = r per token
    a = policy_loss(logprob, old_same, adv, mask, mode="gspo")[0]
    b = policy_loss(logprob, old_same, adv, mask, mode="vanilla")[0]
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0.0)
    # and otherwise not: the sequence's mean log-ratio replaces each token's
    assert abs(float(policy_loss(logprob, old, adv, mask, mode="gspo")[0])
               - float(policy_loss(logprob, old, adv, mask, mode="vanilla")[0])) > 1e-4


def test_sapo_gate():
    logprob, old, adv, mask, _ = _loss_inputs(10)
    config = LossConfig(sapo_tau_pos=1.5, sapo_tau_neg=3.0)
    loss, _ = policy_loss(logprob, old, adv, mask, mode="sapo", config=config)
    tau = torch.where(adv > 0, 1.5, 3.0)
    expected = (-adv * torch.sigmoid(tau * ((logprob - old).exp() - 1)) * 4 / tau * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("mode", ["cispo", "gspo", "sapo", "cispo_seq", "sapo_seq", "vespo"])
def test_modes_compose_with_lambda_high_entropy_and_the_entropy_bonus(mode):
    logprob, old, adv, mask, weights = _loss_inputs(11)
    entropy = torch.rand(logprob.shape, dtype=torch.float64).requires_grad_(True)
    lp = logprob.clone().requires_grad_(True)
    config = LossConfig(pos_adv_weight=0.0, high_entropy_fraction=0.5, entropy_coef=0.01)
    loss, m = policy_loss(lp, old, adv, mask, mode=mode, config=config, entropy=entropy, weights=weights)
    loss.backward()
    assert torch.isfinite(loss) and float(m["high_entropy_frac"]) == pytest.approx(0.5, abs=0.05)
    if mode not in ("gspo", "sapo_seq"):  # λ+ = 0: tokens with A > 0 get no policy gradient (a sequence ratio's
        # gradient couples its row's tokens)
        assert float(lp.grad[(adv > 0) & mask].abs().max()) == 0.0
    assert float(entropy.grad[mask].abs().min()) > 0  # the bonus on every valid token


def test_trl_loss_code_matches_the_modes():
    """TRL 1.16's own ``GRPOTrainer._compute_loss`` on a stand-in trainer (its per-token log-probs given), against
    policy_loss: loss types cispo / sapo / grpo at sequence level (GSPO) / dapo, with its vLLM importance ratio
    in each of the four modes and the off-policy mask."""
    trl = pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    rows, cols = 6, 9
    g = torch.Generator().manual_seed(12)
    mask = (torch.arange(cols)[None, :] < torch.randint(2, cols + 1, (rows,), generator=g)[:, None])
    logprob = -2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old = logprob + 0.2 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    sampling = old + 0.1 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)

    def trl_loss(loss_type, level, is_ratio, opsm, eps_low, eps_high, lp):
        args = SimpleNamespace(use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0,
                               sapo_temperature_neg=1.05, steps_per_generation=1)
        accel = SimpleNamespace(num_processes=1, sync_gradients=True,
                                reduce=lambda t, reduction="sum": t, gather=lambda t: t,
                                gather_for_metrics=lambda t: t)
        stand_in = SimpleNamespace(
            top_entropy_quantile=1.0, off_policy_mask_threshold=opsm, importance_sampling_level=level, beta=0.0,
            loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, args=args, accelerator=accel,
            use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
            model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
            _entropy_bonus_enabled=False, aux_loss_enabled=False,
            _metrics={"train": __import__("collections").defaultdict(list)},
            get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
            _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        )
        inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1),
                  "completion_ids": torch.zeros(rows, cols, dtype=torch.long), "completion_mask": mask.double(),
                  "advantages": adv, "old_per_token_logps": old, "sampling_per_token_logps": sampling,
                  "num_items_in_batch": mask.sum().double()}
        if is_ratio is not None:
            inputs["importance_sampling_ratio"] = is_ratio
        return GRPOTrainer._compute_loss(stand_in, None, inputs)

    from fastcov.correction import rollout_correction as weights_of

    # TRL's vLLM ratio: exp((old − sampling)·mask), summed for sequence_*, then clamp or mask (no ±20 bound:
    # these inputs stay far inside it)
    log_ratio = old - sampling
    cases = [("cispo", "token", "cispo", None), ("sapo", "token", "sapo", None), ("grpo", "sequence", "gspo", None),
             ("dapo", "token", "vanilla", None), ("dapo", "token", "vanilla", 0.02), ("cispo", "token", "cispo", 0.0),
             ("cispo", "sequence", "cispo_seq", None), ("sapo", "sequence", "sapo_seq", 0.02)]
    for is_mode in (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        for loss_type, level, mode, opsm in cases:
            weights, trl_ratio = None, None
            if is_mode is not None:
                lvl, how = is_mode.split("_")
                weights, _ = weights_of(log_ratio, mask, level=lvl, mode=how, clip_max=1.15, clip_min=0.9)
                d = (log_ratio * mask).sum(-1, keepdim=True) if lvl == "sequence" else log_ratio * mask
                trl_ratio = d.exp()
                keep = (trl_ratio >= 0.9) & (trl_ratio <= 1.15)
                trl_ratio = trl_ratio.clamp(0.9, 1.15) if how == "truncate" else trl_ratio.masked_fill(~keep, 0.0)
            if opsm is not None:
                keep, _ = off_policy_sequence_mask(logprob - sampling, adv, mask, opsm)
                weights = keep.double() if weights is None else weights * keep
            eps_high = 1.3 if loss_type == "cispo" else 0.28
            lp_theirs = logprob.clone().requires_grad_(True)
            theirs = trl_loss(loss_type, level, trl_ratio, opsm, 0.2, eps_high, lp_theirs)
            theirs.backward()
            agg = "seq-mean-token-mean" if loss_type in ("grpo", "sapo") else "token-mean"
            config = LossConfig(clip_low=0.2, clip_high=0.28, cispo_clip_max=1.3)
            lp_ours = logprob.clone().requires_grad_(True)
            ours, _ = policy_loss(lp_ours, old, adv[:, None].expand(rows, cols), mask, mode=mode, agg=agg,
                                  config=config, weights=weights)
            ours.backward()
            label = (is_mode, loss_type, opsm)
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=0.0, msg=lambda m, label=label: f"{label}: {m}")
            if mode in ("gspo", "sapo_seq") and is_mode is not None and is_mode.startswith("token"):
                # TRL's sequence ratio carries its gradient through the row mean, so each token's gradient takes
                # the row's mean weight; verl's token form (fastcov's) takes the token's own: same loss value
                assert not torch.allclose(lp_ours.grad, lp_theirs.grad)
                torch.testing.assert_close(lp_ours.grad.sum(-1), lp_theirs.grad.sum(-1), rtol=1e-10, atol=1e-14)
                continue
            torch.testing.assert_close(lp_ours.grad, lp_theirs.grad, rtol=1e-10, atol=1e-14,
                                       msg=lambda m, label=label: f"{label}: {m}")
    assert trl.__version__.startswith("1.")


def test_vespo_is_trls_gamma_weighting():
    """VESPO against TRL 1.16's own ``GRPOTrainer.get_gamma_weights`` on random tensors (with and without its
    token-level vLLM ratio, which fastcov folds into the old log-probs): the same loss and gradient."""
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    rows, cols = 7, 9
    g = torch.Generator().manual_seed(13)
    mask = (torch.arange(cols)[None, :] < torch.randint(1, cols + 1, (rows,), generator=g)[:, None])
    logprob = -2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old = logprob + 0.15 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask[1] = False  # an empty row
    params = dict(k_pos=1.5, lambda_pos=2.5, k_neg=3.5, lambda_neg=1.5)
    config = LossConfig(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=3.5, vespo_lambda_neg=1.5)
    is_ratio = torch.exp(0.1 * torch.randn(rows, cols, generator=g, dtype=torch.float64)).clamp(0.9, 1.1)
    is_ratio = torch.where(mask, is_ratio, torch.ones_like(is_ratio))  # TRL's ratio on padding: exp(0) = 1
    phis = []
    for ratio in (None, is_ratio):
        lp_theirs = logprob.clone().requires_grad_(True)
        phi = GRPOTrainer.get_gamma_weights(adv[:, None], lp_theirs - old, mask.double(), ratio, **params)
        theirs = (-phi * adv[:, None] * lp_theirs * mask).sum() / mask.sum()
        theirs.backward()
        folded = old if ratio is None else old - torch.where(mask, ratio.log(), 0.0)
        lp_ours = logprob.clone().requires_grad_(True)
        ours, _ = policy_loss(lp_ours, folded, adv[:, None].expand(rows, cols), mask, mode="vespo", config=config)
        ours.backward()
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(lp_ours.grad, lp_theirs.grad, rtol=1e-12, atol=1e-15)
        phis.append(phi)
    assert float((phis[0] - phis[1]).abs().max()) > 1e-3  # the vLLM ratio moves the weights
    assert float((phis[0] - 1).abs().max()) > 1e-2  # and the weights are not all 1


def test_vespo_weight_is_one_on_policy_and_carries_no_gradient():
    logprob, _, adv, mask, _ = _loss_inputs(14)
    lp = logprob.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, logprob, adv, mask, mode="vespo")  # w = 1: φ = 1, the plain policy gradient
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * mask / mask.sum(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["vespo_k_pos", "vespo_lambda_neg"])
def test_vespo_parameters_are_checked(name):
    with pytest.raises(ValueError, match=name):
        LossConfig(**{name: -1.0})


@pytest.mark.parametrize("mode, agg", [("gspo", "seq-mean-token-mean"), ("sapo_seq", "token-mean"),
                                       ("cispo_seq", "seq-mean-token-sum"), ("vanilla", "seq-mean-token-mean"),
                                       ("vespo", "token-mean")])
def test_segments_make_a_packed_row_equal_its_padded_rows(mode, agg):
    """Two sequences packed into one row (``segments`` telling them apart) give the loss and gradient of the same two
    as padded rows: the sequence ratio is each one's own (VESPO's sum too), and seq-* aggregations count two."""
    logprob, old, adv, mask, _ = _loss_inputs(15, rows=2, cols=6)
    mask[:] = True
    mask[1, 4:] = False
    packed = [torch.cat([x[0], x[1, :4]])[None] for x in (logprob, old, adv)]
    segments = torch.tensor([[1] * 6 + [2] * 4])
    config = LossConfig(clip_low=0.05, clip_high=0.05)
    lp_padded, lp_packed = logprob.clone().requires_grad_(True), packed[0].clone().requires_grad_(True)
    padded_loss, _ = policy_loss(lp_padded, old, adv, mask, mode=mode, agg=agg, config=config)
    packed_loss, _ = policy_loss(lp_packed, packed[1], packed[2], torch.ones(1, 10, dtype=torch.bool), mode=mode,
                                 agg=agg, config=config, segments=segments)
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-12, atol=0.0)
    (padded_loss + packed_loss).backward()
    torch.testing.assert_close(lp_packed.grad[0], torch.cat([lp_padded.grad[0], lp_padded.grad[1, :4]]), rtol=1e-12,
                               atol=1e-15)
    unsegmented, _ = policy_loss(packed[0], packed[1], packed[2], torch.ones(1, 10, dtype=torch.bool), mode=mode,
                                 agg=agg, config=config)
    assert abs(float(unsegmented) - float(padded_loss.detach())) > 1e-6  # without segments: the row is one sequence


def test_bad_segments_name_the_argument():
    logprob, old, adv, mask, _ = _loss_inputs(16)
    for bad in (torch.zeros(2, 2, dtype=torch.long), torch.ones_like(logprob)):  # wrong shape, floating
        with pytest.raises(ValueError, match="segments"):
            policy_loss(logprob, old, adv, mask, mode="gspo", segments=bad)


def test_gspo_dual_clip_bounds_the_loss_of_negative_advantages():
    """Mode gspo applies dual_clip_c (TRL's delta with GSPO): where A < 0 and the sequence ratio s > c the token loss
    is −A·c with no gradient; elsewhere the plain GSPO loss."""
    rows, cols = 6, 7
    g = torch.Generator().manual_seed(21)
    mask = torch.arange(cols)[None, :] < torch.randint(2, cols + 1, (rows,), generator=g)[:, None]
    logprob = (-2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logprob.detach() - 0.3 * torch.rand(rows, 1, generator=g, dtype=torch.float64)  # s = e^0..e^0.3 per row
    adv = torch.tensor([-1.0, -0.5, 0.7, -2.0, 1.0, -0.3], dtype=torch.float64)[:, None].expand(rows, cols)
    c = 1.15
    loss, _ = policy_loss(logprob, old, adv, mask, mode="gspo", agg="token-mean",
                          config=LossConfig(clip_low=0.1, clip_high=0.1, dual_clip_c=c))
    plain, _ = policy_loss(logprob, old, adv, mask, mode="gspo", agg="token-mean",
                           config=LossConfig(clip_low=0.1, clip_high=0.1))
    s = torch.exp(((logprob.detach() - old) * mask).sum(-1) / mask.sum(-1))
    bound = (adv[:, 0] < 0) & (s > c)
    assert 0 < int(bound.sum()) < rows  # the case binds on some rows, not all
    per_row = torch.where(bound, -adv[:, 0] * c, torch.maximum(-adv[:, 0] * s, -adv[:, 0] * s.clamp(0.9, 1.1)))
    expected = (per_row[:, None].expand(rows, cols) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0.0)
    assert float(loss) < float(plain)
    (grad,) = torch.autograd.grad(loss, logprob)
    assert bool((grad[bound] == 0).all()) and bool((grad[~bound[:, None] & mask] != 0).any())
