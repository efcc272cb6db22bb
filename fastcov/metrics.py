"""Evaluation metrics from one set of samples: pass@k, mean@k, diversity and calibration.

Pure functions of lists / tensors (no model, no I/O except ``reliability_plot``). Shapes:

* ``correct``: bool/0-1 array-like [P, n] — P prompts, n samples each (the same n for every prompt), or a
  list of P per-prompt lists of possibly different lengths;
* ``confidence``: float [N] in [0, 1]; ``outcome``: bool/0-1 [N] (N samples, flattened over prompts);
* token samples: a list of sequences (lists of token ids or words) — one prompt's samples.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with n samples of which c
are correct, the unbiased estimate of P(at least one of k fresh samples is correct) is
``1 − C(n−c, k) / C(n, k)``, computed as a product (no huge binomials). It equals the fraction of the
size-k subsets of the n samples that hold a correct one (the tests check this by enumeration).

mean@k: the expected accuracy of k samples, estimated from the same n samples as the average of the
subset accuracies over all size-k subsets — which is exactly c/n for every k (each sample is in the same
number of subsets). It is reported per k so tables line up with pass@k; it differs across k only when
the per-prompt sample counts differ (prompts with fewer than k samples are left out of k's average).

Diversity: distinct-n (Li et al. 2016) = distinct n-grams / total n-grams over one prompt's samples;
the number of distinct final answers (None = no answer, not counted).

Calibration: a sample's confidence is the policy's own probability of its response, by default the
geometric mean of its token probabilities ``exp(mean log p)`` (``sequence_confidence``). ECE with M equal-
width bins = Σ_b (|b|/N)·|acc_b − conf_b|; Brier = mean (confidence − outcome)².
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "CalibrationBin",
    "brier_score",
    "calibration_bins",
    "distinct_answers",
    "distinct_n",
    "expected_calibration_error",
    "mean_at_k",
    "pass_at_k",
    "pass_at_k_table",
    "reliability_plot",
    "sequence_confidence",
]


def _rows(correct) -> list[list[bool]]:
    """[P, n] array-like (tensor, ndarray, nested lists) → list of per-prompt lists of bools."""
    if hasattr(correct, "tolist"):
        correct = correct.tolist()
    rows = []
    for i, row in enumerate(correct):
        if hasattr(row, "tolist"):
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"correct must be [P, n] (a list of per-prompt lists), row {i} is {row!r}")
        rows.append([bool(x) for x in row])
    return rows


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: n samples, c correct, k ≤ n. ``1 − C(n−c, k)/C(n, k)``."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"n, c, k must be ints, got {n!r}, {c!r}, {k!r}")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    # C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_at_k(n: int, c: int, k: int) -> float:
    """Expected accuracy of k of the n samples (average over all size-k subsets) = c/n for any 1 ≤ k ≤ n."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return c / n


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def pass_at_k_table(correct, ks: Iterable[int] | None = None) -> dict[str, float]:
    """pass@k and mean@k averaged over prompts, for every k in ``ks`` (default 1, 2, 4, ..., n).

    Args:
        correct: [P, n] 0/1 (see the module docstring; ragged rows allowed).
        ks: the k values; a prompt with fewer than k samples is left out of k's averages.
    Returns:
        {"pass@k": ..., "mean@k": ..., "n_prompts@k": ...} for each k (NaN-free: a k no prompt reaches is
        left out).
    """
    rows = _rows(correct)
    if not rows:
        return {}
    n_max = max(len(r) for r in rows)
    ks = sorted(set(default_ks(n_max) if ks is None else ks))
    out: dict[str, float] = {}
    for k in ks:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        use = [r for r in rows if len(r) >= k]
        if not use:
            continue
        out[f"pass@{k}"] = sum(pass_at_k(len(r), sum(r), k) for r in use) / len(use)
        out[f"mean@{k}"] = sum(mean_at_k(len(r), sum(r), k) for r in use) / len(use)
        out[f"n_prompts@{k}"] = len(use)
    return out


# ------------------------------------------------------------------------------------------------ diversity

def distinct_n(samples: Sequence[Sequence], n: int = 2) -> float:
    """Distinct-n over one prompt's samples: |distinct n-grams| / |n-grams| (0 when there are none).

    ``samples``: sequences of hashable tokens (token ids, or words: pass ``text.split()``).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [tuple(s[i : i + n]) for s in samples for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def distinct_answers(answers: Iterable[str | None]) -> int:
    """Number of distinct final answers (whitespace-insensitive); None (no answer) is not counted."""
    return len({"".join(a.split()) for a in answers if a is not None})


# ------------------------------------------------------------------------------------------------ calibration

def sequence_confidence(token_logprobs: Sequence[float], kind: str = "geometric") -> float:
    """The policy's confidence in one response from its token log-probs.

    ``geometric``: exp(mean log p) (length-normalised; the default); ``joint``: exp(Σ log p), the
    probability of the whole sequence. An empty response has confidence 1 (``geometric``/``joint`` of
    nothing).
    """
    lps = [float(x) for x in token_logprobs]
    if kind not in ("geometric", "joint"):
        raise ValueError(f"kind must be 'geometric' or 'joint', got {kind!r}")
    if not lps:
        return 1.0
    total = sum(lps)
    value = math.exp(total / len(lps)) if kind == "geometric" else math.exp(total)
    return min(1.0, max(0.0, value))


def _check_pairs(confidence, outcome) -> tuple[list[float], list[float]]:
    if hasattr(confidence, "tolist"):
        confidence = confidence.tolist()
    if hasattr(outcome, "tolist"):
        outcome = outcome.tolist()
    conf = [float(x) for x in confidence]
    out = [float(bool(x)) for x in outcome]
    if len(conf) != len(out):
        raise ValueError(f"confidence has {len(conf)} values, outcome {len(out)}")
    for x in conf:
        if not (0.0 <= x <= 1.0):
            raise ValueError(f"confidences must be in [0, 1], got {x}")
    return conf, out


@dataclass(frozen=True)
class CalibrationBin:
    lo: float
    hi: float
    count: int
    confidence: float  # mean confidence in the bin (NaN when empty)
    accuracy: float  # fraction correct in the bin (NaN when empty)


def calibration_bins(confidence, outcome, bins: int = 10) -> list[CalibrationBin]:
    """Equal-width bins over [0, 1]; a confidence of exactly 1 falls in the last bin."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    conf, out = _check_pairs(confidence, outcome)
    sums = [[0, 0.0, 0.0] for _ in range(bins)]
    for c, o in zip(conf, out, strict=True):
        b = min(bins - 1, int(c * bins))
        sums[b][0] += 1
        sums[b][1] += c
        sums[b][2] += o
    res = []
    for b, (cnt, cs, os_) in enumerate(sums):
        res.append(CalibrationBin(b / bins, (b + 1) / bins, int(cnt), cs / cnt if cnt else math.nan,
                                  os_ / cnt if cnt else math.nan))
    return res


def expected_calibration_error(confidence, outcome, bins: int = 10) -> float:
    """ECE = Σ_b (|b|/N)·|acc_b − conf_b| over equal-width bins (0 for no samples)."""
    bs = calibration_bins(confidence, outcome, bins)
    total = sum(b.count for b in bs)
    if total == 0:
        return 0.0
    return sum(b.count / total * abs(b.accuracy - b.confidence) for b in bs if b.count)


def brier_score(confidence, outcome) -> float:
    """mean (confidence − outcome)² (0 for no samples)."""
    conf, out = _check_pairs(confidence, outcome)
    return sum((c - o) ** 2 for c, o in zip(conf, out, strict=True)) / len(conf) if conf else 0.0


def reliability_plot(curves: dict[str, list[CalibrationBin]], path, title: str = "Reliability") -> None:
    """Accuracy vs mean confidence per bin, one line per name in ``curves``, with the diagonal; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="gray", lw=1, ls="--", label="perfect calibration")
    for name, bs in curves.items():
        pts = [(b.confidence, b.accuracy) for b in bs if b.count]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (geometric-mean token probability)")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
