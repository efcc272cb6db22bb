"""The entropy–performance law of Cui et al. (2025, arXiv 2505.22617): R = −a·exp(H) + b.

``fit_entropy_law(entropy, reward)`` fits the law by ordinary least squares of R on x = exp(H)
(R = b − a·x, so the slope is −a), reports R² and the predicted ceiling b − a (the reward at H = 0,
i.e. once the policy is fully collapsed), and, with ``fit_fraction < 1``, fits on the first part of
the run only (points in step order) and reports the RMSE of that fit on the remaining points — the
paper's "fit on the first ~15% of steps, predict the rest" check.

All arithmetic is float64 NumPy. Plotting uses matplotlib's Agg canvas directly (no pyplot state),
imported only when :meth:`EntropyLaw.plot` is called.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["EntropyLaw", "fit_entropy_law", "MIN_FIT_POINTS"]

# Two points always fit a line exactly (R² = 1 says nothing); ask for at least three.
MIN_FIT_POINTS = 3


def _as_1d(values: Any, name: str) -> np.ndarray:
    try:
        if hasattr(values, "detach"):  # torch tensor
            values = values.detach().cpu().double().numpy()
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a 1-D sequence of numbers") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{name} has a non-finite value at index {bad}: {arr[bad]!r}")
    return arr


@dataclass
class EntropyLaw:
    """A fitted law R = b − a·exp(H).

    Attributes:
        a, b: coefficients (floats); a > 0 is the usual case (reward falls as entropy rises).
        r2: coefficient of determination of the fit on its own points (1.0 when the fitted rewards
            are all equal and therefore fitted exactly).
        n_fit: number of points the fit used (the first ``n_fit`` in step order).
        n_total: number of points given.
        fit_fraction: the fraction asked for.
        holdout_rmse: RMSE of the fit's predictions on points ``n_fit:``; None when ``fit_fraction == 1``.
        entropy, reward: the data (float64 arrays of shape [n_total]), kept for :meth:`plot`.
    """

    a: float
    b: float
    r2: float
    n_fit: int
    n_total: int
    fit_fraction: float = 1.0
    holdout_rmse: float | None = None
    entropy: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, compare=False)
    reward: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, compare=False)

    @property
    def ceiling(self) -> float:
        """Predicted reward at zero entropy, b − a."""
        return self.b - self.a

    def predict(self, entropy: Any) -> Any:
        """R̂ = b − a·exp(H). A scalar gives a float; an array-like gives a float64 array of its shape."""
        h = np.asarray(entropy, dtype=np.float64)
        out = self.b - self.a * np.exp(h)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary (no data arrays)."""
        return {
            "a": self.a,
            "b": self.b,
            "r2": self.r2,
            "ceiling": self.ceiling,
            "n_fit": self.n_fit,
            "n_total": self.n_total,
            "fit_fraction": self.fit_fraction,
            "holdout_rmse": self.holdout_rmse,
        }

    def summary(self) -> str:
        """Multi-line human-readable report."""
        lines = [
            "entropy law R = -a*exp(H) + b",
            f"  a         = {self.a:.6g}",
            f"  b         = {self.b:.6g}",
            f"  R^2       = {self.r2:.4f}",
            f"  ceiling   = {self.ceiling:.6g}   (b - a, predicted R at H = 0)",
            f"  points    = {self.n_fit} fitted of {self.n_total}",
        ]
        if self.holdout_rmse is None:
            lines.append("  hold-out  = none (fit_fraction = 1)")
        else:
            lines.append(f"  hold-out RMSE = {self.holdout_rmse:.6g}   "
                         f"(fit on the first {self.fit_fraction:g} of steps, "
                         f"predicting the other {self.n_total - self.n_fit})")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike, *, xlabel: str = "entropy H", ylabel: str = "reward R",
             title: str | None = None) -> str:
        """Save a PNG (or any format matplotlib infers from the suffix): R vs H, fitted points as dots,
        held-out points as crosses, the fitted curve over the data's entropy range, the ceiling dashed.
        Returns the path as a string."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        if self.entropy.size == 0:
            raise ValueError("this EntropyLaw carries no data to plot (entropy is empty)")
        fig = Figure(figsize=(6.0, 4.2), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        h, r, n = self.entropy, self.reward, self.n_fit
        ax.scatter(h[:n], r[:n], s=18, color="tab:blue", label=f"fitted ({n} points)", zorder=3)
        if n < h.size:
            ax.scatter(h[n:], r[n:], s=26, marker="x", color="tab:orange",
                       label=f"held out ({h.size - n}), RMSE {self.holdout_rmse:.3g}", zorder=3)
        lo, hi = float(h.min()), float(h.max())
        pad = 0.05 * (hi - lo) if hi > lo else 0.05
        grid = np.linspace(max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad, 200)
        ax.plot(grid, self.predict(grid), color="black", lw=1.5,
                label=f"R = {self.b:.3g} - {self.a:.3g}·exp(H),  R² {self.r2:.3f}")
        ax.axhline(self.ceiling, color="gray", ls="--", lw=1, label=f"ceiling b - a = {self.ceiling:.3g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title or "entropy law fit")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = os.fspath(path)
        fig.savefig(path)
        return path


def fit_entropy_law(entropy: Sequence[float] | Any, reward: Sequence[float] | Any, *,
                    fit_fraction: float = 1.0) -> EntropyLaw:
    """Fit R = b − a·exp(H) by least squares of R on x = exp(H).

    Args:
        entropy: policy entropy per step, 1-D, in step order (list, NumPy array or torch tensor).
        reward: the reward/accuracy at the same steps, same length.
        fit_fraction: fraction in (0, 1] of the points, from the start, to fit on:
            ``n_fit = floor(fit_fraction · n)`` (all points when ``fit_fraction == 1``; at least one
            point is held out otherwise); the rest are held out and predicted (``holdout_rmse``).

    Returns:
        :class:`EntropyLaw`.

    Raises:
        ValueError: naming the argument: ``entropy``/``reward`` of different lengths, not 1-D or with
            non-finite values; ``fit_fraction`` outside (0, 1] or leaving fewer than
            ``MIN_FIT_POINTS`` (3) points in the fit; fewer than 3 points in all;
            ``entropy`` constant over the fitted points (the slope is undefined).
    """
    h = _as_1d(entropy, "entropy")
    r = _as_1d(reward, "reward")
    if h.size != r.size:
        raise ValueError(f"entropy and reward must have the same length, got {h.size} and {r.size}")
    if isinstance(fit_fraction, bool) or not isinstance(fit_fraction, (int, float)) \
            or not math.isfinite(fit_fraction) or not 0.0 < fit_fraction <= 1.0:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction!r}")
    n = h.size
    if n < MIN_FIT_POINTS:
        raise ValueError(f"entropy/reward need at least {MIN_FIT_POINTS} points, got {n}")
    n_fit = n if fit_fraction == 1.0 else int(math.floor(fit_fraction * n + 1e-9))
    if n_fit < MIN_FIT_POINTS:
        raise ValueError(f"fit_fraction={fit_fraction:g} of {n} points leaves {n_fit} in the fit; "
                         f"need at least {MIN_FIT_POINTS}")

    x = np.exp(h[:n_fit])
    y = r[:n_fit]
    xm, ym = x.mean(), y.mean()
    dx = x - xm
    sxx = float(dx @ dx)
    if not sxx > 1e-300 or np.ptp(h[:n_fit]) == 0.0:
        raise ValueError("entropy is constant over the fitted points; the law's slope is undefined")
    slope = float(dx @ (y - ym)) / sxx
    b = float(ym - slope * xm)
    a = -slope
    resid = y - (b - a * x)
    ss_res = float(resid @ resid)
    ss_tot = float((y - ym) @ (y - ym))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0.0 else 1.0
    holdout = None
    if n_fit < n:
        err = r[n_fit:] - (b - a * np.exp(h[n_fit:]))
        holdout = float(np.sqrt(np.mean(err * err)))
    return EntropyLaw(a=a, b=b, r2=r2, n_fit=n_fit, n_total=n, fit_fraction=float(fit_fraction),
                      holdout_rmse=holdout, entropy=h, reward=r)
