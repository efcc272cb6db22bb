import math

import pytest
import torch

from fastcov.kernels.covariance_torch import random_keys_torch
from fastcov.selection import (
    decorrelated_keys,
    draw_seed,
    float_order_key,
    random_keys,
    select_largest,
    select_random_in_band,
    select_random_matched,
    select_top_covariance,
)


def _reference_top(scores: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """Plain-Python reference: sort valid tokens by (score desc, flat position asc), take k."""
    flat_scores = scores.reshape(-1).tolist()
    valid_positions = [i for i, v in enumerate(mask.reshape(-1).tolist()) if v]
    if not valid_positions:
        return torch.zeros_like(mask, dtype=torch.bool)
    k = min(max(1, math.floor(ratio * len(valid_positions))), len(valid_positions))
    chosen = sorted(valid_positions, key=lambda i: (-flat_scores[i], i))[:k]
    out = torch.zeros(mask.numel(), dtype=torch.bool)
    out[chosen] = True
    return out.reshape(mask.shape)


def _random_case(g: torch.Generator, rows: int, cols: int, ties: bool):
    if ties:
        scores = torch.randint(-3, 4, (rows, cols), generator=g).to(torch.float64) * 0.5
    else:
        scores = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mask = torch.rand(rows, cols, generator=g) < 0.7
    mask[0] = False  # a fully masked row
    return scores, mask


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("ratio", [1e-3, 0.07, 0.5, 1.0])
def test_top_covariance_matches_python_reference(ties, ratio):
    g = torch.Generator().manual_seed(1000 + int(ratio * 1000) + ties)
    for rows, cols in [(1, 1), (3, 7), (5, 13), (9, 31)]:
        scores, mask = _random_case(g, rows, cols, ties)
        mask[-1, -1] = True  # at least one valid token
        selected = select_top_covariance(scores, mask, ratio)
        assert selected.dtype == torch.bool and selected.shape == scores.shape
        torch.testing.assert_close(selected, _reference_top(scores, mask, ratio))


def test_top_covariance_float32_and_negative_zero():
    scores = torch.tensor([[-0.0, 0.0, -1.0, 2.0, 2.0]], dtype=torch.float32)
    mask = torch.ones_like(scores, dtype=torch.bool)
    # k = 3: both 2.0 and then the first of the two equal zeros (-0.0 == +0.0), by position
    expected = torch.tensor([[True, False, False, True, True]])
    torch.testing.assert_close(select_top_covariance(scores, mask, 0.6), expected)


def test_top_covariance_all_masked_selects_nothing():
    scores = torch.randn(4, 5, dtype=torch.float64)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    assert not select_top_covariance(scores, mask, 0.5).any()


def test_top_covariance_accepts_float_mask():
    g = torch.Generator().manual_seed(3)
    scores, mask = _random_case(g, 6, 11, ties=False)
    torch.testing.assert_close(
        select_top_covariance(scores, mask.to(torch.float32), 0.2), select_top_covariance(scores, mask, 0.2)
    )


def test_float_order_key_is_monotone():
    values = torch.tensor(
        [-math.inf, -1e300, -2.5, -1e-310, -0.0, 0.0, 1e-310, 1.0, 3.5, 1e300, math.inf], dtype=torch.float64
    )
    keys = float_order_key(values)
    assert (keys[1:] >= keys[:-1]).all()
    assert keys[4] == keys[5]  # -0.0 and +0.0 share a key
    assert ((keys[1:] > keys[:-1]) | (values[1:] == values[:-1])).all()


@pytest.mark.parametrize("seed", range(6))
def test_radix_select_equals_topk_select(seed):
    """The group algorithm (radix select) run without a group must equal the local top-k path."""
    g = torch.Generator().manual_seed(seed)
    scores, mask = _random_case(g, 7, 19, ties=seed % 2 == 0)
    if seed == 5:
        scores = -scores.abs()  # all keys negative: exercises the sign bit of the radix
    order = float_order_key(scores)
    for need in [0, 1, 2, 5, int(mask.sum())]:
        need_t = torch.tensor(need)
        local = select_largest(order, mask, need_t, bound=mask.numel())
        radix = select_largest(order, mask, need_t, bound=mask.numel(), force_radix=True)
        torch.testing.assert_close(local, radix)
        assert int(local.sum()) == need


def test_random_in_band_count_band_and_exclusion():
    g = torch.Generator().manual_seed(7)
    scores = 4 * torch.rand(11, 23, generator=g, dtype=torch.float64) - 1
    mask = torch.rand(11, 23, generator=g) < 0.8
    exclude = torch.rand(11, 23, generator=g) < 0.3
    lb, ub = 0.5, 2.0
    candidates = mask & ~exclude & (scores > lb) & (scores < ub)
    n_valid = int(mask.sum())
    for ratio in [1e-3, 0.05, 0.2, 1.0]:
        selected = select_random_in_band(
            scores, mask, ratio, lb, ub, exclude=exclude, generator=torch.Generator().manual_seed(1)
        )
        assert int(selected.sum()) == min(max(1, math.floor(ratio * n_valid)), int(candidates.sum()))
        assert not (selected & ~candidates).any()


def test_random_in_band_no_candidates_selects_nothing():
    scores = torch.full((3, 5), 10.0, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    assert not select_random_in_band(scores, mask, 0.5, 1.0, 5.0).any()
    assert not select_random_in_band(scores, torch.zeros_like(mask), 0.5, 1.0, 20.0).any()


def test_random_in_band_is_deterministic_per_seed_and_varies_across_seeds():
    g = torch.Generator().manual_seed(8)
    scores = torch.rand(9, 17, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(9, 17, dtype=torch.bool)

    def pick(seed):
        return select_random_in_band(scores, mask, 0.05, 0.5, 2.5, generator=torch.Generator().manual_seed(seed))

    torch.testing.assert_close(pick(3), pick(3))
    assert len({tuple(pick(s).nonzero().reshape(-1).tolist()) for s in range(8)}) > 4


def test_random_in_band_is_uniform_over_candidates():
    scores = torch.ones(1, 20, dtype=torch.float64)
    mask = torch.ones(1, 20, dtype=torch.bool)
    counts = torch.zeros(20)
    trials = 400
    generator = torch.Generator().manual_seed(0)
    for _ in range(trials):
        counts += select_random_in_band(scores, mask, 0.25, 0.0, 2.0, generator=generator).reshape(-1)
    assert counts.sum() == 5 * trials
    # each position: expected 100, binomial sd ≈ 8.7; 5 sd bounds never fail by chance in practice
    assert counts.min() > 56 and counts.max() < 144
    chi2 = float(((counts - 100.0) ** 2 / 100.0).sum())
    assert chi2 < 60  # 19 degrees of freedom: p ≈ 4e-6


def test_random_in_band_uses_given_keys():
    scores = torch.ones(2, 4, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    keys = torch.tensor([[5, 1, 7, 3], [0, 6, 2, 4]], dtype=torch.int64)
    selected = select_random_in_band(scores, mask, 0.375, 0.0, 2.0, keys=keys)  # k = 3
    torch.testing.assert_close(selected, keys >= 5)


def test_random_keys_are_a_function_of_seed_and_global_position():
    seed = torch.tensor([2**61 + 12345], dtype=torch.int64)
    whole = random_keys((6, 7), torch.device("cpu"), seed)
    part = random_keys((2, 7), torch.device("cpu"), seed, torch.tensor(28))
    torch.testing.assert_close(part, whole[4:6])
    assert whole.unique().numel() == whole.numel()
    assert (whole >= 0).all() and (whole < 2**32).all()
    other = random_keys((6, 7), torch.device("cpu"), seed + 1)
    assert (other != whole).float().mean() > 0.9
    # positions beyond 2**32 (the high word enters the hash)
    far = random_keys_torch(seed, torch.tensor([5, 5 + 2**32, 5 + 2**33]))
    assert far.unique().numel() == 3


def test_draw_seed_uses_generator():
    a = draw_seed(torch.Generator().manual_seed(4), torch.device("cpu"))
    b = draw_seed(torch.Generator().manual_seed(4), torch.device("cpu"))
    assert a.dtype == torch.int64 and a.shape == (1,) and torch.equal(a, b) and 0 <= int(a) < 2**62


def test_selectors_never_read_tensor_values_on_the_host():
    """On the meta device every value-dependent host operation (.item(), nonzero, bool(t), .cpu())
    raises, so running the selectors there proves they never synchronise with the host."""
    scores = torch.empty(5, 13, dtype=torch.float32, device="meta")
    mask = torch.empty(5, 13, dtype=torch.bool, device="meta")
    assert select_top_covariance(scores, mask, 0.1).shape == (5, 13)
    assert select_random_in_band(scores, mask, 0.1, 1.0, 5.0, exclude=mask).shape == (5, 13)
    order = torch.empty(5, 13, dtype=torch.int64, device="meta")
    need = torch.empty((), dtype=torch.int64, device="meta")
    assert select_largest(order, mask, need, bound=6, force_radix=True).shape == (5, 13)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_selectors_do_not_synchronize_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(64, 257, device="cuda", generator=g)
    mask = torch.rand(64, 257, device="cuda", generator=g) < 0.8
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        select_top_covariance(scores, mask, 2e-3)
        select_random_in_band(scores, mask, 2e-3, 0.5, 2.0, generator=g)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, math.nan])
def test_bad_ratio_raises(ratio):
    scores = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="ratio must be in"):
        select_top_covariance(scores, mask, ratio)
    with pytest.raises(ValueError, match="ratio must be in"):
        select_random_in_band(scores, mask, ratio, 1.0, 5.0)


def test_bad_arguments_raise_naming_them():
    scores = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="lb must be < ub"):
        select_random_in_band(scores, mask, 0.1, 5.0, 5.0)
    with pytest.raises(ValueError, match="lb must be < ub"):
        select_random_in_band(scores, mask, 0.1, 6.0, 5.0)
    with pytest.raises(ValueError, match="lb must not be NaN"):
        select_random_in_band(scores, mask, 0.1, math.nan, 5.0)
    with pytest.raises(ValueError, match="mask has shape"):
        select_top_covariance(scores, torch.ones(3, 2, dtype=torch.bool), 0.1)
    with pytest.raises(ValueError, match="exclude has shape"):
        select_random_in_band(scores, mask, 0.1, 1.0, 5.0, exclude=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask is on meta"):
        select_top_covariance(scores, torch.ones(2, 3, dtype=torch.bool, device="meta"), 0.1)
    with pytest.raises(TypeError, match="scores must be a floating tensor"):
        select_top_covariance(torch.zeros(2, 3, dtype=torch.int64), mask, 0.1)
    with pytest.raises(TypeError, match="keys must be int64"):
        select_random_in_band(scores, mask, 0.1, 1.0, 5.0, keys=torch.zeros(2, 3))
    with pytest.raises(TypeError, match="ratio must be a float"):
        select_top_covariance(scores, mask, "0.1")


# ---------------------------------------------------------------- the random control of a selection


def _keys(shape, seed):
    return random_keys(shape, torch.device("cpu"), torch.tensor([seed], dtype=torch.int64))


def test_random_matched_takes_as_many_valid_tokens_as_the_reference():
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(5, 11, generator=g) < 0.7
    mask[0] = False
    reference = torch.rand(5, 11, generator=g) < 0.2  # some of it on invalid tokens: not counted
    n_ref = int((reference & mask).sum())
    assert 0 < n_ref < int(reference.sum())
    picked = select_random_matched(reference, mask, _keys(mask.shape, 11))
    assert int(picked.sum()) == n_ref and not (picked & ~mask).any()
    # the keys decide: the n_ref valid tokens with the largest keys (plain-Python reference)
    keys = _keys(mask.shape, 11).reshape(-1).tolist()
    valid = [i for i, v in enumerate(mask.reshape(-1).tolist()) if v]
    expected = torch.zeros(mask.numel(), dtype=torch.bool)
    expected[sorted(valid, key=lambda i: (-keys[i], i))[:n_ref]] = True
    assert torch.equal(picked, expected.reshape(mask.shape))
    assert not select_random_matched(torch.zeros_like(mask), mask, _keys(mask.shape, 1)).any()


def test_random_matched_is_uniform_over_all_valid_tokens_and_deterministic_per_seed():
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[0, 15:] = False
    reference = torch.zeros(1, 20, dtype=torch.bool)
    reference[0, :4] = True  # 4 tokens, all among the first ones: the control must not stay there
    counts = torch.zeros(20)
    trials = 400
    for seed in range(trials):
        counts += select_random_matched(reference, mask, decorrelated_keys(_keys(mask.shape, seed))).reshape(-1)
    assert counts.sum() == 4 * trials and counts[15:].sum() == 0
    # each of the 15 valid positions: expected 4/15 x 400 ≈ 106.7, binomial sd ≈ 8.8
    chi2 = float(((counts[:15] - 4 * trials / 15) ** 2 / (4 * trials / 15)).sum())
    assert chi2 < 50  # 14 degrees of freedom: p ≈ 5e-6
    keys = _keys(mask.shape, 5)
    assert torch.equal(select_random_matched(reference, mask, keys), select_random_matched(reference, mask, keys))


def test_decorrelated_keys_are_a_bijection_with_an_unrelated_order():
    keys = _keys((64, 64), 2**40 + 9)
    again = decorrelated_keys(keys)
    assert again.dtype == torch.int64 and int(again.min()) >= 0 and int(again.max()) < 2**32
    assert again.unique().numel() == keys.unique().numel() == keys.numel()  # no new collisions
    assert torch.equal(again, decorrelated_keys(keys))
    # the top 10% by the two orders overlap as two independent 10% draws would (expected 0.1 x 410)
    top = keys.reshape(-1).topk(410).indices
    top_again = again.reshape(-1).topk(410).indices
    overlap = len(set(top.tolist()) & set(top_again.tolist()))
    assert overlap < 80


def test_random_matched_rejects_bad_inputs_naming_them():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask has shape"):
        select_random_matched(mask, torch.ones(3, 2, dtype=torch.bool), _keys((2, 3), 1))
    with pytest.raises(TypeError, match="keys must be int64"):
        select_random_matched(mask, mask, torch.zeros(2, 3))


def _matched_worker(rank: int, port: int, out_dir: str) -> None:
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        rows = slice(0, 4) if rank == 0 else slice(4, 9)  # unequal shares
        batch = [t[rows] for t in _matched_batch()]
        seed = 7 if rank == 0 else 1007  # only group rank 0's draw may matter
        torch.save(_matched_selections(batch, dist.group.WORLD, seed), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _matched_batch():
    g = torch.Generator().manual_seed(2024)
    mask = torch.arange(17)[None, :] < torch.randint(1, 18, (9,), generator=g)[:, None]
    logprob = -3 * torch.rand(9, 17, generator=g, dtype=torch.float64)
    old = logprob + 0.2 * torch.randn(9, 17, generator=g, dtype=torch.float64)
    adv = (2 * torch.randn(9, 1, generator=g, dtype=torch.float64)).expand(9, 17) * mask
    return logprob, old, adv.contiguous(), mask


def _matched_selections(batch, group, seed):
    from fastcov.losses import LossConfig, compute_global_selection

    cfg = LossConfig(clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=1.5, kl_cov_ratio=0.1, cov_score="random_matched")
    out = {}
    for mode in ("clip_cov", "kl_cov"):
        sel = compute_global_selection(*batch, mode=mode, config=cfg, group=group,
                                       generator=torch.Generator().manual_seed(seed))
        out[mode] = (sel.cov, sel.reference)
    return out


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_random_matched_over_two_gloo_ranks_equals_one_process(tmp_path):
    from _dist import free_port, spawn_ranks

    spawn_ranks(_matched_worker, (free_port(), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = _matched_selections(_matched_batch(), None, 7)
    for mode, (control, reference) in single.items():
        assert 1 < int(control.sum()) == int(reference.sum()) and not torch.equal(control, reference)
        assert torch.equal(torch.cat([r[mode][0] for r in ranks]), control), mode
        assert torch.equal(torch.cat([r[mode][1] for r in ranks]), reference), mode
