"""Student's t without scipy (scipy is not a dependency of the study extra): the CDF from the regularized
incomplete beta function, its quantile by bisection, and the intervals a multi-seed study reports: mean ± the
half-width of a ``level`` interval over seeds (n − 1 degrees of freedom), the gap between two arms with Welch's
interval, and the table cell that shows one (tests/trainer/experiments/test_student_t.py: against t tables)."""

from __future__ import annotations

import math
from collections.abc import Sequence

# ---------------------------------------------------------------- Student's t, without scipy


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, dof: float) -> float:
    """P(T ≤ t) for Student's t with ``dof`` > 0 degrees of freedom."""
    x = dof / (dof + t * t)
    tail = 0.5 * _betainc(dof / 2.0, 0.5, x)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, dof: float) -> float:
    """The ``p`` quantile (0 < p < 1) of Student's t, by bisection on ``t_cdf``."""
    if not 0.0 < p < 1.0 or not dof > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and dof > 0, got p={p}, dof={dof}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, dof) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float | None]:
    """(mean, half-width of the ``level`` t-interval); half-width None with fewer than 2 values."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_ci needs at least one value")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, t_quantile(0.5 + level / 2, n - 1) * math.sqrt(var / n)


def diff_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> tuple[float, float | None]:
    """(mean(a) − mean(b), half-width of Welch's ``level`` interval); None when either has < 2 values."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    if len(a) < 2 or len(b) < 2:
        return ma - mb, None
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return ma - mb, 0.0
    dof = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    return ma - mb, t_quantile(0.5 + level / 2, dof) * se


# ---------------------------------------------------------------- the intervals as the report uses them


def _mean_ci_of_known(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """``mean_ci`` of the values that are not None; (None, None) when none is."""
    known = [v for v in values if v is not None]
    return mean_ci(known) if known else (None, None)


def _excludes_zero(mean: float, half: float | None) -> bool:
    return half is not None and abs(mean) > half


def _cell(mean: float | None, half: float | None, spec: str = ".3f") -> str:
    if mean is None:
        return "—"
    return f"{mean:{spec}}" + (f" ± {half:{spec}}" if half is not None else "")
