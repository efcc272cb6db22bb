"""The tabular entropy-dynamics figure: vanilla GRPO, Clip-Cov and KL-Cov on bench/tabular_dynamics.py's
simulator from the same start and sampling seed; entropy and accuracy per step, and accuracy against entropy.

    python -m bench.tabular_figure --plot docs/entropy_dynamics.png     # about 5 s on 2 CPU cores

(``python -m fastcov.dynamics --plot`` up to 0.4.)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.tabular_dynamics import (
    TABULAR_LOSS_OVERRIDES,
    DynamicsConfig,
    DynamicsRun,
    TabularProblem,
    simulate,
)
from fastcov.dynamics import UPDATES

DEFAULT_METHODS: tuple[tuple[str, str], ...] = (
    ("vanilla GRPO", "vanilla"),
    ("Clip-Cov", "clip_cov"),
    ("KL-Cov", "kl_cov"),
)


def compare_methods(problem: TabularProblem | None = None, config: DynamicsConfig | None = None,
                    methods: Sequence[tuple[str, str]] = DEFAULT_METHODS, *,
                    loss_fn: Callable[..., Any] | None = None) -> list[DynamicsRun]:
    """Run :func:`simulate` once per ``(label, mode)`` from the same problem and sampling seed."""
    problem = problem or TabularProblem.random()
    config = config or DynamicsConfig()
    return [simulate(problem, config, mode=mode, label=label, loss_fn=loss_fn) for label, mode in methods]


def plot_runs(runs: Sequence[DynamicsRun], path: str, *, title: str | None = None) -> str:
    """Save a figure with three panels, one line per run: entropy vs step, accuracy vs step, and
    accuracy vs entropy (the trade-off the entropy law describes; runs move right-to-left along it).
    Uses matplotlib's Agg canvas (no pyplot state). Returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13.5, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax_h, ax_r, ax_f = fig.subplots(1, 3)
    for run in runs:
        steps = np.arange(run.entropy.size)
        (line,) = ax_h.plot(steps, run.entropy, lw=1.8, label=f"{run.label} (final {run.entropy[-1]:.2f})")
        ax_r.plot(steps, run.accuracy, lw=1.8, color=line.get_color(),
                  label=f"{run.label} (final {run.accuracy[-1]:.3f})")
        ax_f.plot(run.entropy, run.accuracy, lw=1.5, color=line.get_color(), label=run.label)
    ax_h.set(xlabel="step", ylabel="mean policy entropy H (nats)", title="entropy")
    ax_r.set(xlabel="step", ylabel="mean expected accuracy", title="accuracy")
    ax_f.set(xlabel="mean policy entropy H (nats)", ylabel="mean expected accuracy",
             title="accuracy vs entropy (higher = more entropy kept per accuracy)")
    ax_f.invert_xaxis()
    for ax in (ax_h, ax_r, ax_f):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_f.title.set_fontsize(9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    defaults = DynamicsConfig()
    parser = argparse.ArgumentParser(
        prog="python -m bench.tabular_figure",
        description="Tabular GRPO entropy dynamics: vanilla vs Clip-Cov vs KL-Cov from the same start and seed.")
    parser.add_argument("--plot", default=None, help="save the figure here (PNG)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--answers", type=int, default=64)
    parser.add_argument("--max-correct", type=int, default=24)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--update", choices=UPDATES, default=defaults.update)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--minibatches", type=int, default=defaults.minibatches)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    problem = TabularProblem.random(args.prompts, args.answers, max_correct=args.max_correct, seed=args.seed)
    config = DynamicsConfig(steps=args.steps, group_size=args.group_size, update=args.update, lr=args.lr,
                            epochs=args.epochs, minibatches=args.minibatches, seed=args.seed)
    runs = compare_methods(problem, config)
    print(f"tabular GRPO: {args.prompts} prompts x {args.answers} answers (1-{args.max_correct} correct), "
          f"n={args.group_size}, {args.update} PG, lr={args.lr:g}, {args.epochs} epoch(s) x {args.minibatches} "
          f"mini-batches per rollout, {args.steps} steps, seed {args.seed}")
    print(f"{'method':<14}{'H start':>8}{'H final':>8}{'H mean':>8}{'H@acc.8':>8}{'acc start':>10}{'acc final':>10}"
          f"{'Lemma1 err':>11}{'sec':>6}")
    for run in runs:
        s = run.summary()
        print(f"{run.label:<14}{s['entropy_start']:>8.3f}{s['entropy_final']:>8.3f}{s['entropy_mean']:>8.3f}"
              f"{s['entropy_at_accuracy_0.8']:>8.3f}{s['accuracy_start']:>10.3f}{s['accuracy_final']:>10.3f}"
              f"{s['lemma1_rel_error']:>11.3f}{run.seconds:>6.1f}")
    if args.plot:
        ratios = ", ".join(f"{k}={v:g}" for m in ("clip_cov", "kl_cov") for k, v in TABULAR_LOSS_OVERRIDES[m].items())
        plot_runs(runs, args.plot, title=(
            f"tabular softmax GRPO: {args.prompts} prompts x {args.answers} answers, n={args.group_size}, "
            f"{args.update} PG lr={args.lr:g}, {args.minibatches} mini-batches/rollout, seed {args.seed}; {ratios}"))
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
