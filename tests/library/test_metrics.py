"""fastcov.metrics: pass@k against brute-force enumeration, mean@k, diversity, calibration."""

import itertools
import math
import random

import pytest
import torch

from fastcov.metrics import (
    brier_score,
    calibration_bins,
    default_ks,
    distinct_answers,
    distinct_n,
    expected_calibration_error,
    mean_at_k,
    pass_at_k,
    pass_at_k_table,
    reliability_plot,
    sequence_confidence,
)


def brute_pass(samples: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(samples)), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def brute_mean(samples: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(samples)), k))
    return sum(sum(samples[i] for i in s) / k for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        random.Random(n * 31 + c).shuffle(samples)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass(samples, k), abs=1e-12)
            assert mean_at_k(n, c, k) == pytest.approx(brute_mean(samples, k), abs=1e-12)


def test_pass_at_k_not_the_naive_estimate():
    # 1 correct of 4: pass@2 = 1 - C(3,2)/C(4,2) = 0.5, while 1-(1-1/4)^2 = 0.4375 (biased)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(100, 0, 10) == 0.0 and pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_table_over_prompts_and_ragged_rows():
    correct = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    tab = pass_at_k_table(correct)
    assert default_ks(4) == [1, 2, 4]
    assert set(tab) == {f"{m}@{k}" for m in ("pass", "mean", "n_prompts") for k in (1, 2, 4)}
    for k in (1, 2, 4):
        want = sum(brute_pass(r, k) for r in correct.tolist()) / 3
        assert tab[f"pass@{k}"] == pytest.approx(want)
        assert tab[f"mean@{k}"] == pytest.approx(3 / 12)
    ragged = pass_at_k_table([[1, 0], [0, 0, 1, 1]], ks=[1, 3])
    assert ragged["n_prompts@1"] == 2 and ragged["n_prompts@3"] == 1
    assert ragged["pass@3"] == pytest.approx(brute_pass([0, 0, 1, 1], 3))
    assert ragged["mean@1"] == pytest.approx((0.5 + 0.5) / 2)


def test_diversity():
    assert distinct_n([[1, 2, 3], [1, 2, 3]], 1) == pytest.approx(3 / 6)
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == pytest.approx(3 / 4)
    assert distinct_n([[1], [2]], 2) == 0.0
    assert distinct_n(["a b c".split(), "d e f".split()], 1) == 1.0
    assert distinct_answers(["5", " 5", "6", None, None]) == 2
    assert distinct_answers([None]) == 0


def test_calibration_ece_and_brier():
    conf = [0.9, 0.9, 0.9, 0.9, 0.1, 0.1]
    ok = [1, 1, 1, 0, 0, 0]
    # bin 9 (0.9..1): acc 0.75, conf 0.9 -> |0.15|*4/6; bin 1: acc 0, conf 0.1 -> 0.1*2/6
    assert expected_calibration_error(conf, ok) == pytest.approx(0.15 * 4 / 6 + 0.1 * 2 / 6)
    assert brier_score(conf, ok) == pytest.approx((3 * 0.01 + 0.81 + 2 * 0.01) / 6)
    assert expected_calibration_error([1.0, 0.0], [1, 0]) == 0.0  # perfectly calibrated, edge bins
    bins = calibration_bins([1.0, 0.55], [1, 0], bins=10)
    assert bins[9].count == 1 and bins[5].count == 1 and bins[5].accuracy == 0.0
    with pytest.raises(ValueError):
        brier_score([1.5], [1])
    # ECE of a random predictor on random outcomes with confidence 0.5 is |acc - 0.5|
    rng = random.Random(0)
    outs = [rng.random() < 0.8 for _ in range(1000)]
    assert expected_calibration_error([0.5] * 1000, outs) == pytest.approx(abs(sum(outs) / 1000 - 0.5))


def test_sequence_confidence(tmp_path):
    assert sequence_confidence([math.log(0.5), math.log(0.5)]) == pytest.approx(0.5)
    assert sequence_confidence([math.log(0.5), math.log(0.5)], "joint") == pytest.approx(0.25)
    assert sequence_confidence([]) == 1.0
    path = tmp_path / "rel.png"
    reliability_plot({"run": calibration_bins([0.2, 0.8, 0.9], [0, 1, 1])}, path)
    assert path.stat().st_size > 1000
