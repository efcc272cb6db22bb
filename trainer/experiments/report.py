"""report.md and plots from run directories (each with a metrics.jsonl).

Per run: the entropy at the end (the mean of the last 10% of steps), final validation accuracy, and the
entropy law R = -a*exp(H) + b fitted by ``fastcov.law.fit_entropy_law`` on the (entropy, val_acc) pairs of
the evaluated steps.
Plots: entropy vs step, validation accuracy vs step, R vs H with each run's fitted law.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fastcov.errors import UserError
from fastcov.trainer.runtime.run_dir import read_numbered_metrics

NUMERIC = ("entropy", "val_acc", "reward_mean", "selected_frac", "time/step", "skipped_steps")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (``run_dir.read_metrics``), checked: numbers (or null) under the keys
    the report reads; a bad value raises UserError naming the file, line and key."""
    rows = []
    for lineno, row in read_numbered_metrics(path):
        for key in NUMERIC:
            v = row.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise UserError(f"{path}:{lineno}: {key!r} must be a number or null, got {v!r}")
        rows.append(row)
    return rows


def end_entropy(train_rows: list[dict]) -> float:
    """The entropy a run ends with: the mean over its last 10% of training steps (at least one), since one
    step's 16 prompts are too noisy to set a ratio. The demo's report and the study use this one yardstick."""
    tail = train_rows[-max(1, len(train_rows) // 10):]
    return sum(r["entropy"] for r in tail) / len(tail)


def summarize(run_dir: Path) -> dict[str, Any]:
    recs = read_rows(Path(run_dir) / "metrics.jsonl")
    train = [r for r in recs if r.get("entropy") is not None]
    evals = [r for r in recs if r.get("val_acc") is not None]
    out: dict[str, Any] = {
        "name": Path(run_dir).name,
        "steps": [r["step"] for r in train],
        "entropy": [r["entropy"] for r in train],
        "reward": [r.get("reward_mean") for r in train],
        "eval_steps": [r["step"] for r in evals],
        "val_acc": [r["val_acc"] for r in evals],
        "final_entropy": end_entropy(train) if train else None,
        "first_entropy": train[0]["entropy"] if train else None,
        "initial_val_acc": evals[0]["val_acc"] if evals else None,
        "final_val_acc": evals[-1]["val_acc"] if evals else None,
        "best_val_acc": max(r["val_acc"] for r in evals) if evals else None,
        "selected_frac": _mean([r.get("selected_frac") for r in train]),
        "skipped_steps": train[-1].get("skipped_steps", 0) if train else 0,
        "seconds": sum(r.get("time/step", 0.0) for r in recs),
        "law": None,
        "law_error": None,
        # the last evaluation's pass@k, diversity and calibration (trainer/evaluation.py), when logged
        "last_eval": next((r for r in reversed(evals) if "val_pass@1" in r), None),
    }
    # Pair each evaluation with the entropy of the rollouts of the same step (the policy it evaluated
    # saw those rollouts one update earlier); step 0 has no rollouts and is left out.
    by_step = {r["step"]: r["entropy"] for r in train}
    pairs = [(by_step[r["step"]], r["val_acc"]) for r in evals if r["step"] in by_step]
    out["law_points"] = pairs
    if len(pairs) >= 3:
        from fastcov.law import fit_entropy_law

        try:
            out["law"] = fit_entropy_law([h for h, _ in pairs], [v for _, v in pairs])
        except ValueError as exc:
            out["law_error"] = str(exc)
    else:
        out["law_error"] = f"{len(pairs)} evaluated steps; need >= 3"
    return out


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _fmt(v: Any, spec: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, spec)


def plot_runs(summaries: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        ax.plot(s["steps"], s["entropy"], label=s["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("policy entropy (nats/token)")
    ax.set_title("Entropy vs step")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "entropy.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        ax.plot(s["eval_steps"], s["val_acc"], marker="o", ms=3, label=s["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation accuracy")
    ax.set_title("Validation accuracy vs step")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "val_acc.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, s in enumerate(summaries):
        color = f"C{i}"
        pts = s["law_points"]
        if not pts:
            continue
        h = np.array([p[0] for p in pts])
        v = np.array([p[1] for p in pts])
        ax.scatter(h, v, s=12, color=color, label=s["name"])
        law = s["law"]
        if law is not None:
            grid = np.linspace(0.0, max(h.max(), 1e-3) * 1.05, 100)
            ax.plot(grid, law.b - law.a * np.exp(grid), color=color, lw=1,
                    label=f"{s['name']}: R = -{law.a:.3g} e^H + {law.b:.3g} (R²={law.r2:.2f})")
    ax.set_xlabel("entropy H")
    ax.set_ylabel("validation accuracy R")
    ax.set_title("R vs H with the fitted law")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "law.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def write_report(run_dirs: list[Path], out_dir: Path, title: str = "fastcov report",
                 preamble: str = "") -> tuple[Path, list[dict[str, Any]]]:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out: {str(out_dir)!r} is a file; give a directory for report.md and the plots")
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(Path(d)) for d in run_dirs]
    plots = plot_runs(summaries, out_dir)
    lines = [f"# {title}", ""]
    if preamble:
        lines += [preamble.rstrip(), ""]
    lines += [
        "| run | entropy first → end | val acc initial → final (best) | a | b | R² | ceiling b−a | "
        "mean selected_frac | skipped | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        law = s["law"]
        lines.append(
            f"| {s['name']} | {_fmt(s['first_entropy'])} → {_fmt(s['final_entropy'])} | "
            f"{_fmt(s['initial_val_acc'], '.3f')} → {_fmt(s['final_val_acc'], '.3f')} "
            f"({_fmt(s['best_val_acc'], '.3f')}) | "
            f"{_fmt(law.a if law else None)} | {_fmt(law.b if law else None)} | "
            f"{_fmt(law.r2 if law else None, '.3f')} | {_fmt(law.ceiling if law else None, '.3f')} | "
            f"{_fmt(s['selected_frac'], '.2e')} | {s['skipped_steps']} | {s['seconds']:.0f} |"
        )
    lines += eval_section(summaries, out_dir, plots)
    notes = [s for s in summaries if s["law_error"]]
    if notes:
        lines += [""] + [f"- {s['name']}: no law fit ({s['law_error']})" for s in notes]
    lines += ["", "Plots: " + ", ".join(f"[{p.name}]({p.name})" for p in plots), ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path, summaries


def eval_section(summaries: list[dict[str, Any]], out_dir: Path, plots: list[Path]) -> list[str]:
    """Markdown lines: pass@k / mean@k, diversity and calibration at each run's last evaluation, and the
    reliability plot (appended to ``plots``). Empty when no run logged them."""
    runs = [s for s in summaries if s.get("last_eval")]
    if not runs:
        return []
    ks = sorted({int(k.split("@")[1]) for s in runs for k in s["last_eval"] if k.startswith("val_pass@")})
    top = ks[-1]
    cols = [f"pass@{k}" for k in ks] + [f"mean@{top}", "distinct-2", "distinct answers", "confidence", "ECE", "Brier"]
    keys = [f"val_pass@{k}" for k in ks] + [f"val_mean@{top}", "val_distinct_2", "val_distinct_answers",
                                            "val_confidence", "val_ece", "val_brier"]
    lines = ["", "Last evaluation: pass@k (unbiased), mean@k, diversity over each prompt's samples, calibration "
             "(sequence confidence vs correctness):", "",
             "| run | step | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for s in runs:
        e = s["last_eval"]
        lines.append(f"| {s['name']} | {e['step']} | " + " | ".join(_fmt(e.get(k), ".3f") for k in keys) + " |")
    curves = {}
    for s in runs:
        bins = s["last_eval"].get("val_calibration_bins")
        if isinstance(bins, list) and bins:
            from fastcov.metrics import CalibrationBin

            m = len(bins)
            curves[s["name"]] = [CalibrationBin(i / m, (i + 1) / m, int(b[0]),
                                                b[1] if b[1] is not None else math.nan,
                                                b[2] if b[2] is not None else math.nan) for i, b in enumerate(bins)]
    if curves:
        from fastcov.metrics import reliability_plot

        path = out_dir / "reliability.png"
        reliability_plot(curves, path, title="Reliability at the last evaluation")
        plots.append(path)
    return lines
