import dataclasses
import math

import pytest
import torch

from fastcov.losses import (
    AGGREGATIONS,
    LossConfig,
    Selection,
    compute_global_selection,
    get_policy_loss,
    policy_loss,
    register,
)

MODES = ("vanilla", "clip_cov", "kl_cov")


# ---------------------------------------------------------------- float64 references


def _ref_token_loss(mode, logprob, old_logprob, advantages, selected, config):
    log_ratio = logprob - old_logprob
    if mode == "vanilla":
        log_ratio = log_ratio.clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    if mode == "kl_cov":
        return -advantages * ratio + config.kl_cov_coef * log_ratio.abs() * selected.double()
    low, high = 1 - config.clip_low, 1 + config.clip_high
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(low, high))
    if config.dual_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * config.dual_clip_c), loss)
    if mode == "clip_cov":
        loss = loss * (1 - selected.double())
    return loss


def _ref_aggregate(values, mask, agg, n_tokens=None, n_seqs=None):
    """Row-by-row loop over the verl definitions."""
    rows, cols = mask.shape
    if agg == "token-mean":
        total = sum(values[i, j] for i in range(rows) for j in range(cols) if mask[i, j])
        count = n_tokens if n_tokens is not None else int(mask.sum())
        return total / max(count, 1) if count else values.sum() * 0
    seq_terms = []
    for i in range(rows):
        picked = [values[i, j] for j in range(cols) if mask[i, j]]
        if not picked:
            continue
        seq_sum = sum(picked)
        seq_terms.append(seq_sum / len(picked) if agg == "seq-mean-token-mean" else seq_sum)
    count = n_seqs if n_seqs is not None else len(seq_terms)
    loss = sum(seq_terms) / max(count, 1) if seq_terms else values.sum() * 0
    if agg == "seq-mean-token-sum-norm":
        loss = loss / cols
    return loss


def _ref_loss(mode, agg, batch, selected, config, high_entropy=None, n_tokens=None, n_seqs=None):
    logprob, old_logprob, advantages, mask, entropy = batch
    token_loss = _ref_token_loss(mode, logprob, old_logprob, advantages, selected, config)
    weights = torch.where(
        advantages > 0,
        torch.full_like(advantages, config.pos_adv_weight),
        torch.where(advantages < 0, torch.full_like(advantages, config.neg_adv_weight), torch.ones_like(advantages)),
    )
    token_loss = token_loss * weights
    if high_entropy is not None:
        token_loss = token_loss * high_entropy.double()
    loss = _ref_aggregate(token_loss, mask, agg, n_tokens, n_seqs)
    if config.entropy_coef:
        loss = loss - config.entropy_coef * _ref_aggregate(entropy, mask, agg, n_tokens, n_seqs)
    return loss


def _ref_top(values, mask, ratio):
    flat = values.reshape(-1).tolist()
    positions = [i for i, v in enumerate(mask.reshape(-1).tolist()) if v]
    out = torch.zeros(mask.numel(), dtype=torch.bool)
    if positions:
        k = min(max(1, math.floor(ratio * len(positions))), len(positions))
        out[sorted(positions, key=lambda i: (-flat[i], i))[:k]] = True
    return out.reshape(mask.shape)


def _ref_covariance(logprob, advantages, mask):
    m = mask.double()
    n = m.sum()
    mean_a = (advantages * m).sum() / n
    mean_l = (logprob * m).sum() / n
    return (advantages - mean_a) * (logprob - mean_l) * m


def _batch(seed, rows=9, cols=23):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    lengths[2] = 0
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    logprob = -3 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old_logprob = logprob + 0.4 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    advantages = 2 * torch.randn(rows, 1, generator=g, dtype=torch.float64) + 0.3 * torch.randn(
        rows, cols, generator=g, dtype=torch.float64
    )
    advantages[0, :3] = 0.0  # some zero advantages (neither λ applies)
    advantages = advantages * mask
    entropy = 2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    return logprob, old_logprob, advantages, mask, entropy


def _grads(fn, logprob, entropy):
    lp = logprob.clone().requires_grad_(True)
    ent = entropy.clone().requires_grad_(True)
    loss, metrics = fn(lp, ent)
    grad_lp, grad_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
    grad_ent = torch.zeros_like(entropy) if grad_ent is None else grad_ent
    return loss.detach(), grad_lp, grad_ent, metrics


CONFIG = LossConfig(
    clip_low=0.2,
    clip_high=0.28,
    dual_clip_c=3.0,
    kl_cov_coef=0.7,
    entropy_coef=0.01,
    pos_adv_weight=0.6,
    neg_adv_weight=1.3,
    clip_cov_ratio=0.1,
    clip_cov_lb=-1.0,
    clip_cov_ub=1.0,
    kl_cov_ratio=0.1,
)


# ---------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradients_match_reference(mode, agg):
    batch = _batch(seed=hash((mode, agg)) % 1000)
    logprob, old_logprob, advantages, mask, entropy = batch
    selected = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(9)) < 0.3) & mask

    def ours(lp, ent):
        return policy_loss(
            lp, old_logprob, advantages, mask, mode=mode, agg=agg, config=CONFIG, entropy=ent, selection=selected
        )

    def reference(lp, ent):
        return _ref_loss(mode, agg, (lp, old_logprob, advantages, mask, ent), selected, CONFIG), {}

    loss, grad_lp, grad_ent, _ = _grads(ours, logprob, entropy)
    ref_loss, ref_grad_lp, ref_grad_ent, _ = _grads(reference, logprob, entropy)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_lp, ref_grad_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_ent, ref_grad_ent, rtol=1e-12, atol=1e-12)
    assert grad_lp.abs().sum() > 0 and (grad_lp[~mask] == 0).all()
    if mode == "clip_cov":
        assert (grad_lp[selected] == 0).all()


def test_kl_cov_selects_top_covariance_tokens():
    logprob, old_logprob, advantages, mask, _ = _batch(seed=4)
    config = LossConfig(kl_cov_ratio=0.07, kl_cov_coef=2.0)
    expected = _ref_top(_ref_covariance(logprob, advantages, mask), mask, 0.07)

    def ours(lp, ent):
        return policy_loss(lp, old_logprob, advantages, mask, mode="kl_cov", config=config)

    def reference(lp, ent):
        return _ref_loss("kl_cov", "token-mean", (lp, old_logprob, advantages, mask, ent), expected, config), {}

    loss, grad, _, metrics = _grads(ours, logprob, torch.zeros_like(logprob))
    ref_loss, ref_grad, _, _ = _grads(reference, logprob, torch.zeros_like(logprob))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert float(metrics["selected_frac"]) == pytest.approx(expected.sum().item() / mask.sum().item())


def test_clip_cov_zeroes_a_random_band_selection():
    logprob, old_logprob, advantages, mask, _ = _batch(seed=6)
    config = LossConfig(clip_cov_ratio=0.08, clip_cov_lb=0.05, clip_cov_ub=2.0)
    cov = _ref_covariance(logprob, advantages, mask)
    log_ratio = logprob - old_logprob
    ratio = log_ratio.exp()
    clipped = -advantages * ratio.clamp(0.8, 1.2) > -advantages * ratio
    candidates = mask & (cov > 0.05) & (cov < 2.0) & ~clipped
    k = max(1, math.floor(0.08 * int(mask.sum())))
    assert 0 < k < int(candidates.sum())
    lp = logprob.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        lp, old_logprob, advantages, mask, mode="clip_cov", config=config, generator=torch.Generator().manual_seed(0)
    )
    (grad,) = torch.autograd.grad(loss, lp)
    unclipped_grad = mask & ~clipped & (advantages != 0)
    zeroed = unclipped_grad & (grad == 0)
    assert int(zeroed.sum()) == k and not (zeroed & ~candidates).any()
    assert float(metrics["selected_frac"]) * int(mask.sum()) == pytest.approx(k)


def test_high_entropy_fraction_trains_only_top_entropy_tokens():
    batch = _batch(seed=12)
    logprob, old_logprob, advantages, mask, entropy = batch
    config = dataclasses.replace(CONFIG, high_entropy_fraction=0.2)
    keep = _ref_top(entropy, mask, 0.2)

    def ours(lp, ent):
        return policy_loss(lp, old_logprob, advantages, mask, mode="vanilla", config=config, entropy=ent)

    def reference(lp, ent):
        return _ref_loss("vanilla", "token-mean", (lp, old_logprob, advantages, mask, ent), None, config, keep), {}

    loss, grad, grad_ent, metrics = _grads(ours, logprob, entropy)
    ref_loss, ref_grad, ref_grad_ent, _ = _grads(reference, logprob, entropy)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_ent, ref_grad_ent, rtol=1e-12, atol=1e-12)
    assert ((grad != 0) <= keep).all()
    assert float(metrics["high_entropy_frac"]) == pytest.approx(keep.sum().item() / mask.sum().item())


def test_vocab_cov_score_selects_top_advantage_times_kappa():
    logprob, old_logprob, advantages, mask, _ = _batch(seed=13)
    kappa = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    config = LossConfig(kl_cov_ratio=0.1, cov_score="vocab")
    selection = compute_global_selection(
        logprob, old_logprob, advantages, mask, mode="kl_cov", config=config, vocab_cov=kappa
    )
    torch.testing.assert_close(selection.cov, _ref_top(advantages * kappa, mask, 0.1))
    _, metrics = policy_loss(logprob, old_logprob, advantages, mask, mode="kl_cov", config=config, vocab_cov=kappa)
    assert float(metrics["cov_max"]) == pytest.approx(float((advantages * kappa)[mask].max()))


def test_metrics_match_reference_and_are_detached_tensors():
    logprob, old_logprob, advantages, mask, entropy = _batch(seed=14)
    lp = logprob.clone().requires_grad_(True)
    _, metrics = policy_loss(lp, old_logprob, advantages, mask, mode="kl_cov", config=CONFIG, entropy=entropy)
    for name, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, name
    valid = mask
    ratio = (logprob - old_logprob).exp()
    cov = _ref_covariance(logprob, advantages, mask)
    expected = {
        "ppo_kl": (old_logprob - logprob)[valid].mean(),
        "clipfrac": ((-advantages * ratio.clamp(0.8, 1.28)) > (-advantages * ratio))[valid].double().mean(),
        "cov_mean": cov[valid].mean(),
        "cov_max": cov[valid].max(),
        "pos_adv_frac": (advantages > 0)[valid].double().mean(),
        "neg_adv_frac": (advantages < 0)[valid].double().mean(),
        "entropy": entropy[valid].mean(),
        "selected_frac": torch.tensor(
            max(1, math.floor(0.1 * int(valid.sum()))) / int(valid.sum()), dtype=torch.float64
        ),
        "empty": torch.tensor(0.0),
    }
    for name, value in expected.items():
        torch.testing.assert_close(metrics[name], value.double(), rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_gives_zero_loss_with_grad(mode, agg):
    logprob, old_logprob, advantages, mask, entropy = _batch(seed=15)
    empty = torch.zeros_like(mask)
    lp = logprob.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old_logprob, advantages, empty, mode=mode, agg=agg, config=CONFIG, entropy=entropy)
    assert loss.requires_grad and float(loss.detach()) == 0.0
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert float(metrics["empty"]) == 1.0
    assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("mode", MODES)
def test_garbage_in_padding_does_not_leak(mode):
    logprob, old_logprob, advantages, mask, entropy = _batch(seed=16)
    logprob = logprob.masked_fill(~mask, math.inf)
    old_logprob = old_logprob.masked_fill(~mask, math.nan)
    advantages = advantages.masked_fill(~mask, math.nan)
    entropy = entropy.masked_fill(~mask, -math.inf)
    lp = logprob.clone().requires_grad_(True)
    ent = entropy.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old_logprob, advantages, mask, mode=mode, config=CONFIG, entropy=ent)
    grad_lp, grad_ent = torch.autograd.grad(loss, (lp, ent))
    assert math.isfinite(float(loss.detach())) and torch.isfinite(grad_lp).all() and torch.isfinite(grad_ent).all()
    assert (grad_lp[~mask] == 0).all() and (grad_ent[~mask] == 0).all()
    assert all(math.isfinite(float(v)) for v in metrics.values())


# ---------------------------------------------------------------- scopes


def _split_gradients(mode, agg, batch, config, pieces, generator_seed=0):
    logprob, old_logprob, advantages, mask, entropy = batch
    selection = compute_global_selection(
        logprob, old_logprob, advantages, mask, mode=mode, config=config, entropy=entropy,
        generator=torch.Generator().manual_seed(generator_seed),
    )  # fmt: skip
    global_tokens = int(mask.sum())
    global_seqs = int((mask.sum(-1) > 0).sum())
    lp = logprob.clone().requires_grad_(True)
    ent = entropy.clone().requires_grad_(True)
    total = 0.0
    for rows in torch.tensor_split(torch.arange(mask.shape[0]), pieces):
        rows = slice(int(rows[0]), int(rows[-1]) + 1)
        loss, _ = policy_loss(
            lp[rows], old_logprob[rows], advantages[rows], mask[rows], mode=mode, agg=agg, scope="global",
            config=config, entropy=ent[rows], global_tokens=global_tokens, global_seqs=global_seqs,
            selection=selection.rows(rows),
        )  # fmt: skip
        total = total + loss
    grad_lp, grad_ent = torch.autograd.grad(total, (lp, ent))
    return total.detach(), grad_lp, grad_ent, selection


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("mode", MODES)
def test_global_scope_is_invariant_to_the_microbatch_split(mode, agg):
    batch = _batch(seed=17, rows=11, cols=19)
    config = dataclasses.replace(CONFIG, high_entropy_fraction=0.6)
    whole = _split_gradients(mode, agg, batch, config, 1)
    for pieces in (2, 4):
        split = _split_gradients(mode, agg, batch, config, pieces)
        torch.testing.assert_close(split[0], whole[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(split[1], whole[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(split[2], whole[2], rtol=1e-12, atol=1e-12)
    assert whole[1].abs().sum() > 0
    # one global-scope call without a precomputed selection computes the same selection
    logprob, old_logprob, advantages, mask, entropy = batch
    direct = _grads(
        lambda lp, ent: policy_loss(
            lp, old_logprob, advantages, mask, mode=mode, agg=agg, scope="global", config=config, entropy=ent,
            global_tokens=int(mask.sum()), global_seqs=int((mask.sum(-1) > 0).sum()),
            generator=torch.Generator().manual_seed(0),
        ),
        logprob, entropy,
    )  # fmt: skip
    torch.testing.assert_close(direct[1], whole[1], rtol=1e-12, atol=1e-12)


def test_global_tokens_may_be_a_tensor():
    logprob, old_logprob, advantages, mask, _ = _batch(seed=18)
    args = (logprob, old_logprob, advantages, mask)
    a, _ = policy_loss(*args, mode="vanilla", scope="global", global_tokens=100)
    b, _ = policy_loss(*args, mode="vanilla", scope="global", global_tokens=torch.tensor(100))
    torch.testing.assert_close(a, b)


def microbatch_vs_global_selection(pieces=4, seed=19, ratio=0.02):
    """KL-Cov tokens selected per micro-batch (scope="microbatch") vs once per mini-batch ("global")."""
    logprob, old_logprob, advantages, mask, _ = _batch(seed=seed, rows=16, cols=64)
    config = LossConfig(kl_cov_ratio=ratio)
    global_selection = compute_global_selection(
        logprob, old_logprob, advantages, mask, mode="kl_cov", config=config
    ).cov
    micro_selection = torch.zeros_like(mask)
    for rows in torch.tensor_split(torch.arange(mask.shape[0]), pieces):
        rows = slice(int(rows[0]), int(rows[-1]) + 1)
        micro_selection[rows] = compute_global_selection(
            logprob[rows], old_logprob[rows], advantages[rows], mask[rows], mode="kl_cov", config=config
        ).cov
    return mask, global_selection, micro_selection


def test_microbatch_scope_selects_differently_from_global_scope():
    mask, global_selection, micro_selection = microbatch_vs_global_selection()
    n_valid = int(mask.sum())
    assert int(global_selection.sum()) == max(1, math.floor(0.02 * n_valid))
    assert not torch.equal(global_selection, micro_selection)


# ---------------------------------------------------------------- registry


def test_users_can_register_a_mode():
    @register("test_plain_pg", override=True)
    def plain_pg(logprob, old_logprob, advantages, selected, config):
        return -advantages * torch.exp(logprob - old_logprob)

    logprob, old_logprob, advantages, mask, _ = _batch(seed=20)
    loss, _ = policy_loss(logprob, old_logprob, advantages, mask, mode="test_plain_pg")
    expected = (-advantages * (logprob - old_logprob).exp())[mask].mean()
    torch.testing.assert_close(loss, expected)
    assert get_policy_loss("test_plain_pg").loss is plain_pg
    with pytest.raises(ValueError, match="already registered"):
        register("test_plain_pg")(plain_pg)


def test_registered_selector_is_used():
    def select_first(inputs):
        out = torch.zeros_like(inputs.valid)
        out[:, 0] = True
        return out

    @register("test_zero_first", selector=select_first, override=True)
    def zero_first(logprob, old_logprob, advantages, selected, config):
        return torch.where(selected, 0.0, -advantages * torch.exp(logprob - old_logprob))

    logprob, old_logprob, advantages, mask, _ = _batch(seed=21)
    _, metrics = policy_loss(logprob, old_logprob, advantages, mask, mode="test_zero_first")
    assert float(metrics["selected_frac"]) == pytest.approx(int(mask[:, 0].sum()) / int(mask.sum()))


def test_policy_loss_never_reads_tensor_values_on_the_host():
    """Meta tensors have no values: any .item()/nonzero/bool(tensor) in the loss path would raise."""
    shape = (5, 13)
    meta = dict(device="meta", dtype=torch.float32)
    config = LossConfig(check_finite=False, entropy_coef=0.01, high_entropy_fraction=0.5, dual_clip_c=3.0)
    for mode in MODES:
        loss, metrics = policy_loss(
            torch.empty(shape, **meta), torch.empty(shape, **meta), torch.empty(shape, **meta),
            torch.empty(shape, device="meta", dtype=torch.bool), mode=mode, config=config,
            entropy=torch.empty(shape, **meta), scope="global", global_tokens=torch.empty((), **meta),
        )  # fmt: skip
        assert loss.shape == () and all(v.shape == () for v in metrics.values())


# ---------------------------------------------------------------- bad input


def test_bad_config_raises_naming_the_field():
    with pytest.raises(ValueError, match="clip_cov_ratio must be in"):
        LossConfig(clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov_ratio must be in"):
        LossConfig(kl_cov_ratio=1.5)
    with pytest.raises(ValueError, match="kl_cov_ratio must be in"):
        LossConfig(kl_cov_ratio=-2e-4)
    with pytest.raises(ValueError, match="clip_cov_lb must be < clip_cov_ub"):
        LossConfig(clip_cov_lb=5.0, clip_cov_ub=5.0)
    with pytest.raises(ValueError, match="high_entropy_fraction must be in"):
        LossConfig(high_entropy_fraction=0.0)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        LossConfig(dual_clip_c=1.0)
    with pytest.raises(ValueError, match="cov_score must be one of"):
        LossConfig(cov_score="exact")
    with pytest.raises(ValueError, match="clip_low must be ≥ 0"):
        LossConfig(clip_low=-0.1)
    with pytest.raises(ValueError, match="entropy_coef must be finite"):
        LossConfig(entropy_coef=math.nan)
    with pytest.raises(TypeError, match="pos_adv_weight must be a real number"):
        LossConfig(pos_adv_weight="1")


def test_bad_arguments_raise_naming_them():
    logprob, old_logprob, advantages, mask, entropy = _batch(seed=22)
    args = (logprob, old_logprob, advantages, mask)
    with pytest.raises(ValueError, match="mode must be one of"):
        policy_loss(*args, mode="dppo_tv")
    with pytest.raises(ValueError, match="agg must be one of"):
        policy_loss(*args, mode="vanilla", agg="token-sum")
    with pytest.raises(ValueError, match="scope must be one of"):
        policy_loss(*args, mode="vanilla", scope="rank")
    with pytest.raises(ValueError, match="old_logprob has shape"):
        policy_loss(logprob, old_logprob[:, :-1], advantages, mask, mode="vanilla")
    with pytest.raises(ValueError, match="mask has shape"):
        policy_loss(logprob, old_logprob, advantages, mask[:-1], mode="vanilla")
    with pytest.raises(ValueError, match="advantages is on meta"):
        policy_loss(logprob, old_logprob, advantages.to("meta"), mask, mode="vanilla")
    with pytest.raises(ValueError, match=r"logprob must be \[B, T\]"):
        policy_loss(logprob[0], old_logprob[0], advantages[0], mask[0], mode="vanilla")
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = advantages.clone()
        poisoned[3, 0] = bad
        with pytest.raises(ValueError, match="advantages must be finite"):
            policy_loss(logprob, old_logprob, poisoned, mask, mode="kl_cov")
    with pytest.raises(ValueError, match="global_tokens is required"):
        policy_loss(*args, mode="vanilla", scope="global")
    with pytest.raises(ValueError, match="global_seqs is required"):
        policy_loss(*args, mode="vanilla", scope="global", agg="seq-mean-token-mean", global_tokens=10)
    with pytest.raises(ValueError, match="global_tokens must be ≥ 0"):
        policy_loss(*args, mode="vanilla", global_tokens=-1)
    with pytest.raises(ValueError, match="entropy is required"):
        policy_loss(*args, mode="vanilla", config=LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="entropy is required"):
        policy_loss(*args, mode="vanilla", config=LossConfig(high_entropy_fraction=0.2))
    with pytest.raises(ValueError, match="vocab_cov is required"):
        policy_loss(*args, mode="kl_cov", config=LossConfig(cov_score="vocab"))
    with pytest.raises(TypeError, match="selection.cov must be a bool tensor"):
        policy_loss(*args, mode="kl_cov", selection=mask.double())
    with pytest.raises(ValueError, match="selection.cov has shape"):
        policy_loss(*args, mode="kl_cov", selection=mask[:-1])
    with pytest.raises(ValueError, match="selection.high_entropy is required"):
        policy_loss(
            *args, mode="vanilla", scope="global", global_tokens=10, entropy=entropy,
            config=LossConfig(high_entropy_fraction=0.2), selection=Selection(),
        )  # fmt: skip
    with pytest.raises(TypeError, match="config must be a LossConfig"):
        policy_loss(*args, mode="vanilla", config={"clip_low": 0.2})
    with pytest.raises(TypeError, match="entropy must be a floating tensor"):
        policy_loss(*args, mode="vanilla", entropy=mask)


# ---------------------------------------------------------------- the random-selection control and diagnostics


@pytest.mark.parametrize("mode", ["kl_cov", "clip_cov"])
def test_random_score_selects_as_many_tokens_at_random(mode):
    """cov_score="random" picks the same number of tokens as the covariance score, but others, and a
    different set for another seed; the diagnostics still report the real c_t of what was picked."""
    from fastcov.losses import LossConfig, policy_loss

    gen = torch.Generator().manual_seed(0)
    B, T = 16, 40
    logprob = -torch.rand(B, T, generator=gen) * 3
    old = logprob + 0.01 * torch.randn(B, T, generator=gen)
    adv = torch.randn(B, 1, generator=gen).expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=gen) < 0.9
    base = dict(clip_cov_ratio=0.05, kl_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=5.0)
    picks, metrics = {}, {}
    for score, seed in (("batch", 0), ("random", 0), ("random", 1)):
        cfg = LossConfig(cov_score=score, **base)
        _, m = policy_loss(logprob, old, adv, mask, mode=mode, config=cfg, generator=torch.Generator().manual_seed(seed))
        from fastcov.losses import compute_global_selection

        sel = compute_global_selection(logprob, old, adv, mask, mode=mode, config=cfg,
                                       generator=torch.Generator().manual_seed(seed))
        picks[(score, seed)] = sel.cov
        metrics[(score, seed)] = m
    n = {k: int(v.sum()) for k, v in picks.items()}
    k = max(1, int(0.05 * int(mask.sum())))
    assert n[("random", 0)] == n[("random", 1)] == k  # every valid token is a candidate of the random score
    assert 0 < n[("batch", 0)] <= k and (mode == "clip_cov" or n[("batch", 0)] == k)
    assert not torch.equal(picks[("batch", 0)], picks[("random", 0)])
    assert not torch.equal(picks[("random", 0)], picks[("random", 1)])
    m = metrics[("random", 0)]
    assert float(m["selected_frac"]) > 0 and 0 <= float(m["selected_pos_adv"]) <= float(m["selected_frac"])
    if mode == "kl_cov":  # top covariance tokens have the largest c_t: above the random pick's on average
        assert float(metrics[("batch", 0)]["selected_cov"]) > float(m["selected_cov"])


# ---------------------------------------------------------------- Clip-Cov's random control (cov_score="random_matched")

MATCHED = LossConfig(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=2.0, kl_cov_ratio=0.1)


def _band_candidates(batch, config):
    logprob, old_logprob, advantages, mask, _ = batch
    cov = _ref_covariance(logprob, advantages, mask)
    ratio = (logprob - old_logprob).exp()
    clipped = -advantages * ratio.clamp(1 - config.clip_low, 1 + config.clip_high) > -advantages * ratio
    return mask & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub) & ~clipped


@pytest.mark.parametrize("band", [(0.8, 1.2), (0.05, 2.0)])  # the band limits the count / k = ⌊0.1·n⌋ does
def test_random_matched_detaches_as_many_tokens_as_clip_cov_uniformly_among_valid_ones(band):
    batch = _batch(seed=6)
    logprob, old_logprob, advantages, mask, _ = batch
    config = dataclasses.replace(MATCHED, clip_cov_lb=band[0], clip_cov_ub=band[1])
    matched = dataclasses.replace(config, cov_score="random_matched")
    k = max(1, math.floor(0.1 * int(mask.sum())))
    candidates = _band_candidates(batch, config)
    n_pick = min(k, int(candidates.sum()))
    assert 0 < n_pick and (n_pick < k) == (band[1] < 2)
    counts = torch.zeros(mask.shape)
    outside = 0
    for seed in range(300):
        clip = compute_global_selection(logprob, old_logprob, advantages, mask, mode="clip_cov", config=config,
                                        generator=torch.Generator().manual_seed(seed))
        ctrl = compute_global_selection(logprob, old_logprob, advantages, mask, mode="clip_cov", config=matched,
                                        generator=torch.Generator().manual_seed(seed))
        assert torch.equal(ctrl.reference, clip.cov)  # the same seed: exactly what Clip-Cov would pick
        assert int(ctrl.cov.sum()) == int(clip.cov.sum()) == n_pick and not (ctrl.cov & ~mask).any()
        counts += ctrl.cov
        outside += int((ctrl.cov & ~candidates).sum())
    assert outside > 0.5 * 300 * n_pick  # most picks fall outside the band (it holds a minority of valid tokens)
    n_valid = int(mask.sum())
    expected = 300 * n_pick / n_valid
    chi2 = float((((counts - expected) ** 2 / expected) * mask).sum())
    assert counts[~mask].sum() == 0 and chi2 < n_valid + 6 * math.sqrt(2 * n_valid)  # uniform over valid tokens


def test_random_matched_zeroes_the_loss_and_gradient_of_its_tokens_float64_reference():
    batch = _batch(seed=6)
    logprob, old_logprob, advantages, mask, entropy = batch
    matched = dataclasses.replace(MATCHED, cov_score="random_matched")
    sel = compute_global_selection(logprob, old_logprob, advantages, mask, mode="clip_cov", config=matched,
                                   generator=torch.Generator().manual_seed(4))
    loss, grad_lp, _, metrics = _grads(lambda lp, ent: policy_loss(
        lp, old_logprob, advantages, mask, mode="clip_cov", config=matched, generator=torch.Generator().manual_seed(4)
    ), logprob, entropy)
    lp = logprob.clone().requires_grad_(True)
    ref = _ref_loss("clip_cov", "token-mean", (lp, old_logprob, advantages, mask, entropy), sel.cov, matched)
    (ref_grad,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_lp, ref_grad, rtol=1e-12, atol=1e-12)
    assert (grad_lp[sel.cov] == 0).all() and (grad_lp[mask & ~sel.cov & (advantages != 0)] != 0).any()
    # the denominator keeps them: the same loss as vanilla with their terms set to 0, over all valid tokens
    n = int(mask.sum())
    assert float(metrics["selected_frac"]) * n == pytest.approx(int(sel.cov.sum()))
    both, either = float(metrics["selected_and_ref"]) * n, float(metrics["selected_or_ref"]) * n
    assert both == pytest.approx(int((sel.cov & sel.reference).sum()))
    assert either == pytest.approx(int((sel.cov | sel.reference).sum())) and both < either


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_random_controls_are_deterministic_by_seed_and_report_the_overlap(mode):
    logprob, old_logprob, advantages, mask, _ = _batch(seed=6)

    def pick(score, seed):
        config = dataclasses.replace(MATCHED, cov_score=score)
        return compute_global_selection(logprob, old_logprob, advantages, mask, mode=mode, config=config,
                                        generator=torch.Generator().manual_seed(seed))

    batch_pick = pick("batch", 0)
    assert batch_pick.reference is None
    for score in ("random", "random_matched"):
        a, b, c = pick(score, 0), pick(score, 0), pick(score, 1)
        assert torch.equal(a.cov, b.cov) and torch.equal(a.reference, b.reference)
        assert not torch.equal(a.cov, c.cov)
        if mode == "kl_cov":  # the reference is KL-Cov's own top-k: no randomness in it
            assert torch.equal(a.reference, batch_pick.cov)
        assert int(a.cov.sum()) == int(a.reference.sum()) or score == "random"
    _, metrics = policy_loss(logprob, old_logprob, advantages, mask, mode=mode, config=MATCHED)
    assert "selected_and_ref" not in metrics  # the diagnostic exists only for a random control


def test_random_matched_is_a_config_option_that_needs_a_selection():
    from fastcov.errors import ConfigError
    from fastcov.trainer.config import load_config

    assert LossConfig(cov_score="random_matched").cov_score == "random_matched"
    with pytest.raises(ValueError, match="cov_score must be one of"):
        LossConfig(cov_score="random_match")
    cfg = load_config("configs/demo.yaml", ["algo.mode=clip_cov", "algo.loss.cov_score=random_matched"])
    assert cfg.algo.loss.cov_score == "random_matched"
    with pytest.raises(ConfigError, match="^algo.loss.cov_score: random_matched is a control"):
        load_config("configs/demo.yaml", ["algo.mode=vanilla", "algo.loss.cov_score=random_matched"])
