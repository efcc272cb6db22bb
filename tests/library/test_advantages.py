import math
import statistics

import pytest
import torch

from fastcov.advantages import (
    available_advantages,
    broadcast_to_tokens,
    dapo_filter,
    dr_grpo,
    get_advantage,
    grpo,
    register_advantage,
    reinforce_pp,
    rloo,
)


def _groups_of(rewards, ids):
    groups = {}
    for i, gid in enumerate(ids):
        groups.setdefault(gid, []).append(i)
    return groups


def _reference(kind, rewards, ids, eps=1e-6):
    values = [float(r) for r in rewards]
    out = [0.0] * len(values)
    for members in _groups_of(values, ids).values():
        group = [values[i] for i in members]
        n = len(group)
        for i in members:
            if kind == "grpo":
                mean, std = (statistics.fmean(group), statistics.stdev(group)) if n > 1 else (0.0, 1.0)
                out[i] = (values[i] - mean) / (std + eps)
            elif kind == "dr_grpo":
                out[i] = values[i] - (statistics.fmean(group) if n > 1 else 0.0)
            elif kind == "rloo":
                out[i] = values[i] - statistics.fmean([values[j] for j in members if j != i]) if n > 1 else values[i]
    return torch.tensor(out, dtype=torch.float64)


def _rewards(seed, num_prompts=7, n=5, binary=False):
    g = torch.Generator().manual_seed(seed)
    if binary:
        return torch.randint(0, 2, (num_prompts * n,), generator=g).to(torch.float64)
    return torch.randn(num_prompts * n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("binary", [False, True])
def test_group_estimators_match_reference_with_contiguous_groups(kind, binary):
    rewards = _rewards(seed=1 + binary, binary=binary)
    ids = [i // 5 for i in range(rewards.numel())]
    got = get_advantage(kind)(rewards, 5)
    torch.testing.assert_close(got, _reference(kind, rewards, ids), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_with_shuffled_ids_and_a_singleton(kind):
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([40, 7, 40, 12, 7, 40, 99, 12, 7, 12, 40])  # 99 is a singleton group
    rewards = torch.randn(ids.numel(), generator=g, dtype=torch.float64)
    got = get_advantage(kind)(rewards, ids)
    torch.testing.assert_close(got, _reference(kind, rewards, ids.tolist()), rtol=1e-12, atol=1e-12)


def test_grpo_all_equal_group_gives_zero_and_float32_stays_float32():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    got = grpo(rewards, 3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[:3], torch.zeros(3))
    expected = torch.tensor([-1.0, 2.0, -1.0]) / 3 / (math.sqrt(1 / 3) + 1e-6)  # mean 1/3, std √(1/3)
    torch.testing.assert_close(got[3:], expected, rtol=1e-5, atol=1e-5)


def test_rloo_equals_leave_one_out_scaled_group_centering():
    rewards = _rewards(seed=4)
    torch.testing.assert_close(rloo(rewards, 5), 5 / 4 * dr_grpo(rewards, 5), rtol=1e-12, atol=1e-12)


def test_reinforce_pp_normalises_over_the_whole_batch():
    rewards = _rewards(seed=5)
    values = rewards.tolist()
    mean, std = statistics.fmean(values), statistics.stdev(values)
    expected = torch.tensor([(v - mean) / (std + 1e-6) for v in values], dtype=torch.float64)
    torch.testing.assert_close(reinforce_pp(rewards), expected, rtol=1e-12, atol=1e-12)
    # REINFORCE++-baseline: group mean first, then global normalisation
    centered = (rewards - rewards.reshape(-1, 5).mean(1).repeat_interleave(5)).tolist()
    mean, std = statistics.fmean(centered), statistics.stdev(centered)
    expected = torch.tensor([(v - mean) / (std + 1e-6) for v in centered], dtype=torch.float64)
    torch.testing.assert_close(reinforce_pp(rewards, 5, group_baseline=True), expected, rtol=1e-12, atol=1e-12)


def test_dapo_filter_drops_groups_with_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.25])
    keep = dapo_filter(rewards, 3)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    ids = torch.tensor([2, 1, 2, 1, 3])
    assert dapo_filter(torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0]), ids).tolist() == [False, False, False, False, False]
    assert dapo_filter(torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]), ids).tolist() == [True, True, True, True, False]


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    got = broadcast_to_tokens(torch.tensor([2.0, -1.0], dtype=torch.float64), mask)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]], dtype=torch.float64))


def test_registry():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(available_advantages())

    @register_advantage("test_raw", override=True)
    def raw(rewards, groups, *, eps=1e-6):
        return rewards

    assert get_advantage("test_raw") is raw
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("test_raw")(raw)
    with pytest.raises(ValueError, match="advantage estimator must be one of .*'grpo'"):
        get_advantage("ppo-gae")


def test_bad_input_raises_naming_the_argument():
    rewards = torch.zeros(6)
    with pytest.raises(ValueError, match="groups: 6 rewards do not split into groups of 4"):
        grpo(rewards, 4)
    with pytest.raises(ValueError, match="groups .* must be ≥ 1"):
        grpo(rewards, 0)
    with pytest.raises(ValueError, match="groups has shape"):
        grpo(rewards, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="groups must hold integer ids"):
        grpo(rewards, torch.zeros(6))
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        grpo(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="rewards must be finite"):
        rloo(torch.tensor([0.0, math.nan]), 2)
    with pytest.raises(ValueError, match="rewards must be finite"):
        dapo_filter(torch.tensor([0.0, math.inf]), 2)
    with pytest.raises(ValueError, match="groups is required"):
        reinforce_pp(rewards, group_baseline=True)
    with pytest.raises(ValueError, match="sequence_advantages must be"):
        broadcast_to_tokens(torch.zeros(3), torch.ones(2, 4, dtype=torch.bool))
