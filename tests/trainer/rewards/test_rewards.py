"""Reward extraction (last \\boxed{}) and checking with math-verify under a time limit."""

import time

import pytest

from fastcov.trainer.rewards import RewardFn, extract_boxed


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{5}.", "5"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("nested \\boxed{\\sqrt{\\frac{a}{b^{2}}}} end", "\\sqrt{\\frac{a}{b^{2}}}"),
    ("$\\boxed 5$", "5"),
    ("\\boxed 12. done", "12"),
    ("first \\boxed{1} then \\boxed{2} finally \\boxed{3}", "3"),
    ("\\boxed{1} and an unclosed \\boxed{2", "1"),
    ("\\fbox{7}", "7"),
    ("no box here: 5", None),
    ("\\boxed{", None),
    ("", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.fixture(scope="module")
def inline():
    fn = RewardFn("binary", timeout_s=5.0, sandbox="inline")
    yield fn
    fn.close()


@pytest.mark.parametrize("response, truth, ok", [
    ("\\boxed{5}", "5", True),
    ("\\boxed{ 5 }", "5", True),
    ("\\boxed 5", "5", True),
    ("\\boxed{6}", "5", False),
    ("5", "5", False),  # no box, no credit
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", False),
    ("\\boxed{4} wait, \\boxed{5}", "5", True),
    ("\\boxed{5} wait, \\boxed{4}", "5", False),
])
def test_binary_rewards(inline, response, truth, ok):
    assert inline(response, truth) == (1.0 if ok else 0.0)


def test_pm1_rewards():
    fn = RewardFn("pm1", sandbox="inline")
    assert fn("\\boxed{3}", "3") == 1.0
    assert fn("\\boxed{4}", "3") == -1.0
    assert fn("nothing", "3") == -1.0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kind"):
        RewardFn("ternary")
    with pytest.raises(ValueError, match="timeout_s"):
        RewardFn(timeout_s=0)
    with pytest.raises(ValueError, match="sandbox"):
        RewardFn(sandbox="docker")


def test_pathological_answer_is_cut_off_by_the_time_limit():
    fn = RewardFn("binary", timeout_s=2.0, sandbox="process")
    try:
        assert fn("\\boxed{\\frac{10}{2}}", "5") == 1.0  # warms the worker up (spawn + imports)
        t0 = time.perf_counter()
        with pytest.warns(UserWarning, match="timed out"):
            assert fn("\\boxed{9^{9^{9^{9}}}}!", "5") == 0.0
        assert time.perf_counter() - t0 < 15.0
        assert fn.timeouts == 1
        assert fn("\\boxed{\\frac{15}{3}}", "5") == 1.0  # a fresh worker takes over
    finally:
        fn.close()
