"""The study's pictures: entropy curves with their bands over seeds, the headline and the target-holding
plots of the controller study, the harder task's, and the selection study's."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastcov.trainer.experiments.study_selection import METHOD_NAMES


def plot_bands(numbers: dict[str, list[dict[str, Any]]], path: Path) -> Path | None:
    """Entropy vs step per arm: the mean over seeds, with the min-max band across seeds."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, runs in numbers.items():
        steps = runs[0]["steps"]
        n = min(len(r["entropy"]) for r in runs)
        cols = [[r["entropy"][i] for r in runs] for i in range(n)]
        mean = [sum(c) / len(c) for c in cols]
        line, = ax.plot(steps[:n], mean, label=f"{arm} ({len(runs)} seeds)")
        ax.fill_between(steps[:n], [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("rollout entropy (nats/token)")
    ax.set_title("Entropy across seeds (line: mean, band: min-max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_headline(numbers: dict[str, list[dict[str, Any]]], target: float, arms: Sequence[str], path: Path,
                  title: str) -> Path | None:
    """One panel: the rollout entropy of ``arms`` against step (mean over seeds, min-max band) and the target as
    a line, the figure a user reads first."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in arms:
        runs = numbers[arm]
        n = min(len(r["entropy"]) for r in runs)
        cols = [[r["entropy"][i] for r in runs] for i in range(n)]
        steps = runs[0]["steps"][:n]
        line, = ax.plot(steps, [sum(c) / len(c) for c in cols], lw=1.4, label=f"{arm} ({len(runs)} seeds)")
        ax.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.2,
                        lw=0)
    ax.axhline(target, color="k", lw=1.0, ls="--", label=f"target {target:g}")
    ax.axhspan(0.9 * target, 1.1 * target, color="0.85", alpha=0.5, lw=0, label="within 10%")
    ax.set_xlabel("step")
    ax.set_ylabel("rollout entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_target(numbers: dict[str, list[dict[str, Any]]], target: float, path: Path,
                baseline: str = "grpo") -> Path | None:
    """One panel per arm: its entropy (mean over seeds, min-max band), the baseline's mean dashed, the target as a
    horizontal line; under it, for arms with a controller, the knob's value (mean over seeds, log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    arms = list(numbers)
    cols = 4
    rows = math.ceil(len(arms) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), sharex=True, sharey=True, squeeze=False)

    def mean_band(runs, key):
        n = min(len(r[key]) for r in runs)
        cols_ = [[r[key][i] for r in runs] for i in range(n)]
        if any(v is None for c in cols_ for v in c):
            return None
        return (runs[0]["steps"][:n], [sum(c) / len(c) for c in cols_], [min(c) for c in cols_],
                [max(c) for c in cols_])

    base = mean_band(numbers[baseline], "entropy") if baseline in numbers else None
    for ax, arm in zip(axes.flat, arms, strict=False):
        steps, mean, lo, hi = mean_band(numbers[arm], "entropy")
        ax.fill_between(steps, lo, hi, color="C0", alpha=0.25, lw=0)
        ax.plot(steps, mean, color="C0", lw=1.2, label=arm)
        if base is not None and arm != baseline:
            ax.plot(base[0], base[1], color="0.5", lw=1.0, ls="--", label=baseline)
        ax.axhline(target, color="C3", lw=1.0, label=f"target {target:g}")
        ax.set_title(arm, fontsize=9)
        ax.tick_params(labelsize=7)
        control = mean_band(numbers[arm], "control_value")
        if control is not None:
            twin = ax.twinx()
            twin.plot(control[0], control[1], color="C2", lw=0.8, alpha=0.8)
            twin.set_yscale("symlog", linthresh=1e-4)
            twin.tick_params(labelsize=6, colors="C2")
    for ax in axes.flat[len(arms):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("entropy (nats/token)", fontsize=8)
    for ax in axes[-1, :]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(f"Rollout entropy per arm (blue: mean over seeds, band min-max; grey dashed: {baseline}; "
                 f"red: target; green, right axis: the controller's knob)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_harder(harder: dict[str, Any], path: Path) -> Path | None:
    """pass@k and mean@k on the held-out problems with one operation more than training: the start model and each
    arm, bars at the mean over seeds with their 95% intervals (``summary["harder"]`` from ``study_tables``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    k = harder["k"]
    names = ["start model"] + list(harder["arms"])
    rows = [harder["start"]] + list(harder["arms"].values())
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4))
    width = 0.38
    for j, metric in enumerate((f"pass@{k}", f"mean@{k}")):
        xs = [i + (j - 0.5) * width for i in range(len(names))]
        means = [r[metric]["mean"] for r in rows]
        errs = [r[metric]["ci95"] or 0.0 for r in rows]
        ax.bar(xs, means, width, yerr=errs, capsize=3, label=metric)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title(f"Problems with one operation more than training, {k} samples each\n"
                 "(bars: mean over seeds, whiskers: 95% CI)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_selection(entries: Sequence[dict[str, Any]], path: Path, labels: dict[str, str] | None = None) -> Path | None:
    """selection − random (mean, 95% interval) against the ratio, one panel per metric (titled by ``labels``) and
    one for the control's Jaccard overlap with c_t's pick beside chance, f / (2 − f); one series per (method,
    prompts per step), nudged apart along the ratio axis so that equal ratios stay readable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = list(dict.fromkeys(k for e in entries for k in e["contrasts"]))
    if not keys:
        return None
    series: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        series.setdefault(f"{METHOD_NAMES.get(e['method'], e['method'])}, {e['prompts']} prompts/step", []).append(e)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    labels = labels or {}
    panels = [(k, f"{labels.get(k, k)}: selection − random") for k in keys] + [
        ("jaccard", "Jaccard index, random vs c_t's pick (dotted: chance, KL-Cov)")]
    ratios = sorted({e["ratio"] for e in entries})
    kl_ratios = sorted({e["ratio"] for e in entries if e["method"] == "kl_cov"})  # chance f / (2 − f) needs f = ratio
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for i, (name, group) in enumerate(series.items()):
            group = sorted(group, key=lambda e: e["ratio"])
            stats = [e["jaccard"] if key == "jaccard" else e["contrasts"].get(key, {}).get("diff") for e in group]
            pts = [(e["ratio"] * 1.06 ** i, s["mean"], s["ci95"] or 0.0) for e, s in zip(group, stats, strict=True)
                   if s and s["mean"] is not None]
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                            capsize=3, label=name)
        if key != "jaccard":
            ax.axhline(0.0, color="grey", lw=0.8)
        elif kl_ratios:
            ax.plot(kl_ratios, [f / (2 - f) for f in kl_ratios], ":", color="grey")
        ax.set_xscale("log")
        ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("ratio")
        ax.set_title(title, fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Covariance selection − random control (mean over seeds, whiskers: 95% CI)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
