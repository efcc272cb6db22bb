"""trainer/experiments/student_t.py: Student's t without scipy, against t tables and closed forms, and the
intervals the study reports."""

import math

import pytest

from fastcov.trainer.experiments.student_t import diff_ci, mean_ci, t_cdf, t_quantile

# t_{0.975, dof}, the two-sided 95% critical values, to 9 significant digits (standard t tables; dof 1 and 2 also
# from their closed forms: 1/tan(0.025π) = 12.7062047 and 0.95·sqrt(2 / (4·0.975·0.025)) = 4.30265273)
T975 = {1: 12.7062047, 2: 4.30265273, 5: 2.57058184, 30: 2.04227246}
# the table's last digit is half a unit of 1e-8 relative at most; the continued fraction stops at 1e-14 and the
# bisection's 200 halvings of [-1e3, 1e3] leave ~1e-57: the table's rounding is what the tolerance covers
TABLE_REL = 1e-8


@pytest.mark.parametrize("dof,want", sorted(T975.items()))
def test_t_quantile_matches_the_tables(dof, want):
    assert t_quantile(0.975, dof) == pytest.approx(want, rel=TABLE_REL)
    assert t_quantile(0.025, dof) == pytest.approx(-want, rel=TABLE_REL)  # symmetric
    assert t_cdf(want, dof) == pytest.approx(0.975, abs=1e-9)  # the table's rounding times the density, < 1e-9


def test_the_closed_forms_at_one_and_two_degrees_of_freedom():
    # dof 1 is Cauchy: F(t) = 1/2 + atan(t)/π; dof 2: F(t) = 1/2 + t / (2·sqrt(2 + t²)); fp64 sums of a few terms
    for t in (-30.0, -2.5, -0.3, 0.0, 0.7, 4.0, 100.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-12)


def test_bad_arguments_name_what_is_wrong():
    for p, dof in ((0.0, 3), (1.0, 3), (0.5, 0), (0.5, -1.0)):
        with pytest.raises(ValueError, match="t_quantile needs 0 < p < 1 and dof > 0"):
            t_quantile(p, dof)
    with pytest.raises(ValueError, match="at least one value"):
        mean_ci([])


def test_mean_ci_and_welch_by_hand():
    mean, half = mean_ci([1.0, 2.0, 3.0])  # sd 1, n 3, dof 2
    assert mean == 2.0 and half == pytest.approx(T975[2] / math.sqrt(3), rel=TABLE_REL)
    assert mean_ci([5.0]) == (5.0, None)
    gap, half = diff_ci([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])  # equal variances and sizes: Welch's dof is 4
    assert gap == 0.0 and half == pytest.approx(2.77644511 * math.sqrt(2 / 3), rel=TABLE_REL)
    assert diff_ci([1.0, 1.0], [0.0, 0.0]) == (1.0, 0.0)  # no spread: an interval of width 0
    assert diff_ci([1.0], [0.0, 2.0]) == (0.0, None)
