"""Rewards beyond the basics: exact numbers, a linear and bounded extract_boxed, the worker pool.

Property-based tests (hypothesis) compare ``extract_boxed`` with a direct (quadratic) reading of its
specification, and check the checker on integers past 2**53, fractions and decimals.
"""

from __future__ import annotations

import re
import threading
import time
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastcov.trainer.rewards import RewardFn, as_rational, extract_boxed


@pytest.fixture(scope="module")
def inline():
    fn = RewardFn("binary", timeout_s=5.0, sandbox="inline")
    yield fn
    fn.close()


# ------------------------------------------------------------------------------------------ exactness

@pytest.mark.parametrize("answer, truth, ok", [
    ("9007199254740993", "9007199254740992", False),  # 2**53 + 1 vs 2**53: equal as floats
    ("9007199254740992", "9007199254740992", True),
    ("9007199254740993", "9007199254740993.0", True),
    ("123456789012345678901234567891", "123456789012345678901234567890", False),
    ("0.30000000000000004", "0.3", False),
    ("0.1", "\\frac{1}{10}", True),
    ("1/3", "0.3333333333333333", False),
    ("\\frac{2}{4}", "0.5", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\dfrac{-3}{6}", "-1/2", True),
    ("1e3", "1000", True),
    ("1.50", "1.5", True),
    ("+7", "7", True),
    ("\\frac{1}{0}", "1", False),
    ("2", "\\sqrt{4}", True),  # not both rational: math-verify decides
])
def test_exact_comparison(inline, answer, truth, ok):
    assert inline(f"so \\boxed{{{answer}}}", truth) == (1.0 if ok else 0.0)


def test_long_literals_are_not_parsed_exactly():
    assert as_rational("1" * 5000) is None  # no 5000-digit int parse (math-verify, time-limited, decides)
    assert as_rational("1e999999999") is None  # no 10**999999999
    assert as_rational("12") == 12


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=st.integers(-(2**80), 2**80), delta=st.integers(-2, 2))
def test_integers_compare_exactly(inline, a, delta):
    b = a + delta
    assert inline(f"\\boxed{{{a}}}", str(b)) == (1.0 if a == b else 0.0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=st.integers(-10**6, 10**6), q=st.integers(1, 10**6), r=st.integers(-10**6, 10**6), s=st.integers(1, 10**6))
def test_fractions_compare_exactly(inline, p, q, r, s):
    expected = Fraction(p, q) == Fraction(r, s)
    assert inline(f"\\boxed{{\\frac{{{p}}}{{{q}}}}}", f"{r}/{s}") == (1.0 if expected else 0.0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=st.decimals(allow_nan=False, allow_infinity=False, places=6, min_value=-10**12, max_value=10**12),
       pad=st.integers(0, 3))
def test_decimals_compare_exactly(inline, d, pad):
    text = format(d, "f")
    padded = text + ("0" * pad if "." in text else ("." + "0" * pad if pad else ""))
    assert inline(f"\\boxed{{{padded}}}", text) == 1.0  # trailing zeros do not matter
    other = d + Decimal("0.000001")
    assert inline(f"\\boxed{{{format(other, 'f')}}}", text) == 0.0  # one millionth does


# ------------------------------------------------------------------------------------------ extract_boxed

def reference_extract(text: str) -> str | None:
    """The specification, read directly (quadratic): the last complete box wins."""
    last = None
    for m in re.finditer(r"\\(?:boxed|fbox)", text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    last = text[i + 1 : j].strip()
                    break
        elif i < len(text) and text[i] == " ":
            arg = re.match(r"[^\s$]+", text[i:].lstrip(" "))
            if arg:
                last = arg.group(0).rstrip(".,")
    return last


TOKENS = st.sampled_from(["\\boxed", "\\fbox", "{", "}", " ", "$", "1", "x", ".", ",", "\\frac", "é", "\n"])


@settings(max_examples=500, deadline=None)
@given(st.lists(TOKENS, max_size=40).map("".join))
def test_extract_boxed_matches_its_specification(text):
    assert extract_boxed(text) == reference_extract(text)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_extract_boxed_never_fails_on_any_text(text):
    out = extract_boxed(text)
    assert out is None or isinstance(out, str)
    assert extract_boxed(f"{text} \\boxed{{42}}") == "42"


@pytest.mark.parametrize("name, text, expected", [
    ("10 MB of open braces", "\\boxed" + "{" * 10_000_000, None),
    ("10 MB of close braces", "\\boxed{1}" + "}" * 10_000_000, "1"),
    ("deep nesting", "\\boxed{" + "{" * 2_000_000 + "7" + "}" * 2_000_000 + "}",
     "{" * 2_000_000 + "7" + "}" * 2_000_000),
    ("a million unclosed boxes", "\\boxed{5} " + "\\boxed{" * 1_000_000, "5"),
])
def test_extract_boxed_is_bounded_on_hostile_strings(name, text, expected):
    t0 = time.perf_counter()
    assert extract_boxed(text) == expected
    assert time.perf_counter() - t0 < 5.0, name  # linear: ~0.1-0.5 s each on a 2-core box


def test_huge_answers_score_wrong_without_parsing(inline):
    t0 = time.perf_counter()
    assert inline("\\boxed{" + "1+" * 100_000 + "1}", "100001") == 0.0
    assert time.perf_counter() - t0 < 2.0


# ------------------------------------------------------------------------------------------ the pool

def test_pool_scores_a_batch_and_replaces_dead_workers():
    fn = RewardFn("binary", timeout_s=2.0, sandbox="process", workers=2)
    try:
        responses = ["\\boxed{\\sqrt{4}}", "\\boxed{3}", "\\boxed{\\sqrt{9}}", "none", "\\boxed{2^{2}}"]
        truths = ["2", "3", "3", "3", "5"]
        assert fn.batch(responses, truths) == [1.0, 1.0, 1.0, 0.0, 0.0]
        # workers killed between batches are replaced; the batch is complete
        for w in fn._pool.workers:
            if w.proc is not None:
                w.proc.kill()
                w.proc.join()
        assert fn.batch(responses, truths) == [1.0, 1.0, 1.0, 0.0, 0.0]
        assert fn.worker_deaths >= 1

        # a worker killed in the middle of a check: that answer is retried on a fresh worker (here it
        # times out again), every other answer of the batch is still scored
        slow = "\\boxed{9^{9^{9^{9}}}}"
        batch = [slow] + ["\\boxed{\\sqrt{16}}"] * 4
        truth = ["5"] + ["4"] * 4
        killed = threading.Event()

        def killer():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not killed.is_set():
                for w in fn._pool.workers:
                    if w.state == "busy" and w.job == 0 and w.proc is not None:
                        time.sleep(0.3)
                        w.proc.kill()
                        killed.set()
                        return
                time.sleep(0.01)

        th = threading.Thread(target=killer)
        th.start()
        deaths = fn.worker_deaths
        with pytest.warns(UserWarning, match="timed out"):
            assert fn.batch(batch, truth) == [0.0, 1.0, 1.0, 1.0, 1.0]
        th.join()
        assert killed.is_set()
        assert fn.worker_deaths > deaths
        assert fn.batch(["\\boxed{\\sqrt{25}}"], ["5"]) == [1.0]  # the pool still works
    finally:
        fn.close()
