"""Statistics and the report of a multi-seed study: mean ± 95% confidence intervals across seeds, the
gap between two arms with its interval, entropy curves with bands, and the entropy law tested as the
paper tests it (fit on the first 15% of GRPO's steps, predict the rest).

Intervals use Student's t with n − 1 degrees of freedom (Welch's for a difference of two arms); with 3
seeds they are wide, and the report says so rather than hiding it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


# ---------------------------------------------------------------- per-run numbers


def run_numbers(run_dir: Path, pass_k: int) -> dict[str, Any]:
    """What the study compares, from one run's metrics.jsonl: entropy at the start and the end (mean of the
    last 10% of steps, so one noisy step does not decide), final validation accuracy, pass@k and mean@k
    of the last evaluation, the distinct final answers per prompt among its k samples (the start model's and the
    end's: a policy that collapses onto one answer per problem loses coverage even where its token entropy
    stays), and the entropy curve."""
    from fastcov.trainer.experiments.report import end_entropy, read_rows

    rows = read_rows(Path(run_dir) / "metrics.jsonl")
    train = [r for r in rows if r.get("entropy") is not None]
    evals = [r for r in rows if r.get("val_acc") is not None]
    if not train:
        raise ValueError(f"{run_dir}: no training steps in metrics.jsonl")
    last = evals[-1] if evals else {}
    first = evals[0] if len(evals) > 1 and evals[0].get("step") == 0 else {}  # the start model, same for every arm
    sel = [r for r in train if r.get("sel/pos_adv_share") is not None]
    return {
        "steps": [r["step"] for r in train],
        "entropy": [r["entropy"] for r in train],
        "rollout_acc": [r.get("acc_mean", r.get("reward_mean")) for r in train],
        "control_value": [r.get("entropy_control/value") for r in train],
        "eval_steps": [r["step"] for r in evals],
        "val_acc": [r["val_acc"] for r in evals],
        "start_entropy": train[0]["entropy"],
        "final_entropy": end_entropy(train),
        "final_val_acc": last.get("val_acc"),
        f"pass@{pass_k}": last.get(f"val_pass@{pass_k}"),
        f"mean@{pass_k}": last.get(f"val_mean@{pass_k}"),
        f"start_pass@{pass_k}": first.get(f"val_pass@{pass_k}"),
        f"start_mean@{pass_k}": first.get(f"val_mean@{pass_k}"),
        "distinct_answers": last.get("val_distinct_answers"),
        "start_distinct_answers": first.get("val_distinct_answers"),
        "selected_tokens": (sum(r.get("sel/tokens_per_update", 0.0) for r in sel) / len(sel)) if sel else None,
        "selected_pos_adv_share": (sum(r["sel/pos_adv_share"] for r in sel) / len(sel)) if sel else None,
        "selected_prob": (sum(r["sel/mean_prob"] for r in sel) / len(sel)) if sel else None,
        "selected_cov": (sum(r["sel/mean_cov"] for r in sel) / len(sel)) if sel else None,
        "selected_pos": _mean_of(train, "sel/mean_pos"),
        "jaccard_vs_cov": _mean_of(train, "sel/jaccard_vs_cov"),
        "harder": _read_harder(Path(run_dir)),
    }


def _mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the rows that have it; None when none does."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _read_harder(run_dir: Path) -> dict[str, Any] | None:
    """The run's harder_eval.json (the demo task's held-out problems with one operation more than training:
    the start model's and the end's numbers), or None when the run has none."""
    import json

    try:
        data = json.loads((run_dir / "harder_eval.json").read_text())
        return data if isinstance(data.get("start"), dict) and isinstance(data.get("end"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def law_holdout(numbers: dict[str, Any], fit_fraction: float = 0.15) -> dict[str, Any] | None:
    """R = −a·e^H + b fitted on the first ``fit_fraction`` of a run's steps (R: the step's rollout
    accuracy, H: its rollout entropy), predicting the rest: holdout RMSE and predicted ceiling b − a."""
    from fastcov.law import fit_entropy_law

    pairs = [(h, r) for h, r in zip(numbers["entropy"], numbers["rollout_acc"], strict=True) if r is not None]
    try:
        law = fit_entropy_law([h for h, _ in pairs], [v for _, v in pairs], fit_fraction=fit_fraction)
    except ValueError as exc:
        return {"error": str(exc), "points": len(pairs)}
    return {"a": law.a, "b": law.b, "ceiling": law.ceiling, "holdout_rmse": law.holdout_rmse,
            "n_fit": law.n_fit, "points": len(pairs)}


# ---------------------------------------------------------------- the report


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


def study_tables(numbers: dict[str, list[dict[str, Any]]], pass_k: int, baseline: str = "grpo",
                 contrasts: Sequence[tuple[str, str]] = ()) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and a summary dict: per arm mean ± 95% CI across seeds; each arm's entropy and
    pass@k gaps to the baseline with Welch's intervals; pass@k / mean@k of the start model; selection
    diagnostics; the law holdout of the baseline. ``contrasts`` adds (arm, other) gaps the same way, e.g. an arm
    against its control."""
    keys = ("start_entropy", "final_entropy", "final_val_acc", f"pass@{pass_k}", f"mean@{pass_k}", "distinct_answers")
    lines = ["| arm | seeds | entropy start | entropy end | entropy end ÷ GRPO's | val acc end | "
             f"pass@{pass_k} | mean@{pass_k} | answers per prompt |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary: dict[str, Any] = {"arms": {}}
    base_end = [n["final_entropy"] for n in numbers.get(baseline, [])]
    for arm, runs in numbers.items():
        stats = {}
        for k in keys:
            stats[k] = _mean_ci_of_known([r.get(k) for r in runs])
        base_mean = sum(base_end) / len(base_end) if base_end else 0.0
        end = stats["final_entropy"][0]
        ratio = end / base_mean if base_mean > 0 and end is not None else None
        summary["arms"][arm] = {k: {"mean": m, "ci95": h} for k, (m, h) in stats.items()}
        summary["arms"][arm]["entropy_ratio_to_baseline"] = ratio
        lines.append(f"| {arm} | {len(runs)} | " + " | ".join(
            [_cell(*stats["start_entropy"]), _cell(*stats["final_entropy"]),
             "—" if ratio is None else f"{ratio:.2f}×", _cell(*stats["final_val_acc"]),
             _cell(*stats[f"pass@{pass_k}"]), _cell(*stats[f"mean@{pass_k}"]),
             _cell(*stats["distinct_answers"], ".2f")]) + " |")
    lines.append("")
    lines += _gap_lines(numbers, pass_k, baseline, contrasts, summary)
    starts = [r for runs in numbers.values() for r in runs if r.get(f"start_pass@{pass_k}") is not None]
    if starts:
        sp = mean_ci([r[f"start_pass@{pass_k}"] for r in starts])
        sm = mean_ci([r[f"start_mean@{pass_k}"] for r in starts])
        summary["start"] = {f"pass@{pass_k}": {"mean": sp[0], "ci95": sp[1]},
                            f"mean@{pass_k}": {"mean": sm[0], "ci95": sm[1]}}
        sd = [r["start_distinct_answers"] for r in starts if r.get("start_distinct_answers") is not None]
        sd_text = ""
        if sd:
            sdc = mean_ci(sd)
            summary["start"]["distinct_answers"] = {"mean": sdc[0], "ci95": sdc[1]}
            sd_text = f", {_cell(*sdc, '.2f')} distinct answers per prompt"
        lines.append(f"- the start model (step 0, every run's first evaluation): pass@{pass_k} {_cell(*sp)}, "
                     f"mean@{pass_k} {_cell(*sm)}{sd_text}.")
        lines += _changes_from_start(numbers, pass_k, summary)
    lines += _harder_lines(numbers, baseline, summary, contrasts)
    lines += ["", "Which tokens the covariance methods acted on (means over steps and seeds):", "",
              "| arm | tokens per update | share with A > 0 | mean p | mean c_t |", "|---|---:|---:|---:|---:|"]
    for arm, runs in numbers.items():
        sel = [r for r in runs if r.get("selected_tokens") is not None]
        if not sel:
            continue
        avg = {k: sum(r[k] for r in sel) / len(sel) for k in ("selected_tokens", "selected_pos_adv_share",
                                                               "selected_prob", "selected_cov")}
        summary["arms"][arm]["selection"] = avg
        lines.append(f"| {arm} | {avg['selected_tokens']:.1f} | {avg['selected_pos_adv_share']:.2f} | "
                     f"{avg['selected_prob']:.3f} | {avg['selected_cov']:.3g} |")
    if baseline in numbers:
        laws = [law_holdout(n) for n in numbers[baseline]]
        ok = [x for x in laws if x and "error" not in x]
        summary["law"] = laws
        lines += ["", f"Entropy law on {baseline} (R = −a·e^H + b with R the step's rollout accuracy, fitted on the "
                  "first 15% of steps, predicting the rest):", ""]
        if ok:
            rmse = mean_ci([x["holdout_rmse"] for x in ok])
            ceil = mean_ci([x["ceiling"] for x in ok])
            lines.append(f"- holdout RMSE {_cell(*rmse)} (accuracy units), predicted ceiling b − a {_cell(*ceil)}, "
                         f"over {len(ok)} seed(s), {ok[0]['n_fit']} fitted of {ok[0]['points']} steps each.")
        for x in laws:
            if x and "error" in x:
                lines.append(f"- a seed could not be fitted: {x['error']}")
    return lines, summary


def _gap_lines(numbers: dict[str, list[dict[str, Any]]], pass_k: int, baseline: str,
               contrasts: Sequence[tuple[str, str]], summary: dict[str, Any]) -> list[str]:
    """Each arm against the baseline, then each contrast: final entropy, pass@k and mean@k gaps with Welch's
    intervals, stated and recorded in ``summary``."""
    lines = []
    pairs = [(arm, baseline) for arm in numbers if arm != baseline and baseline in numbers] + list(contrasts)
    for arm, other in pairs:
        gap, half = diff_ci([n["final_entropy"] for n in numbers[arm]], [n["final_entropy"] for n in numbers[other]])
        entry = {"mean": gap, "ci95": half, "excludes_zero": _excludes_zero(gap, half)}
        key = "" if other == baseline else f"_vs_{other}"
        summary["arms"][arm]["entropy_gap" + key] = entry
        acc_text = ""
        for metric in (f"pass@{pass_k}", f"mean@{pass_k}"):  # mean@k only where pass@k was evaluated
            vals: list[list[Any]] = [[n.get(metric) for n in numbers[x]] for x in (arm, other)]
            if any(v is None for vs in vals for v in vs):
                break
            mgap, mhalf = diff_ci(vals[0], vals[1])
            summary["arms"][arm][f"{metric}_gap" + key] = {"mean": mgap, "ci95": mhalf}
            mverdict = "excludes" if _excludes_zero(mgap, mhalf) else "includes"
            acc_text += f"; {metric}: {_cell(mgap, mhalf)} (the interval {mverdict} 0)"
        verdict = "excludes" if entry["excludes_zero"] else "includes"
        lines.append(f"- {arm} − {other}, final entropy: {_cell(gap, half)} nats/token "
                     f"(the interval {verdict} 0){acc_text}.")
    return lines


def _changes_from_start(numbers: dict[str, list[dict[str, Any]]], pass_k: int, summary: dict[str, Any]) -> list[str]:
    """Per arm, what RL did to pass@k and mean@k: the end minus the start of the same run (so the pairs share
    a seed), mean ± t-interval across seeds. A pass@k that falls while mean@k rises is a policy that solves
    its usual problems more reliably and fewer problems in all."""
    lines = []
    for arm, runs in numbers.items():
        paired = [r for r in runs if None not in (r.get(f"pass@{pass_k}"), r.get(f"start_pass@{pass_k}"),
                                                   r.get(f"mean@{pass_k}"), r.get(f"start_mean@{pass_k}"))]
        if not paired:
            continue
        dp = mean_ci([r[f"pass@{pass_k}"] - r[f"start_pass@{pass_k}"] for r in paired])
        dm = mean_ci([r[f"mean@{pass_k}"] - r[f"start_mean@{pass_k}"] for r in paired])
        verdict = "excludes" if _excludes_zero(*dp) else "includes"
        summary["arms"][arm][f"pass@{pass_k}_change"] = {"mean": dp[0], "ci95": dp[1]}
        summary["arms"][arm][f"mean@{pass_k}_change"] = {"mean": dm[0], "ci95": dm[1]}
        lines.append(f"- {arm}, end − start of the same run: pass@{pass_k} {_cell(*dp)} (the interval {verdict} 0), "
                     f"mean@{pass_k} {_cell(*dm)}.")
    return lines


def _harder_lines(numbers: dict[str, list[dict[str, Any]]], baseline: str, summary: dict[str, Any],
                  contrasts: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The held-out problems with one operation more than training, where every run has them: per arm the end's
    pass@k, mean@k and distinct answers (mean ± CI across seeds), the start model's, each arm's pass@k change
    from its start (paired by seed) and its pass@k and mean@k gaps to the baseline (Welch); then each contrast's."""
    if not numbers or not all(r.get("harder") for runs in numbers.values() for r in runs):
        return []
    first = next(iter(numbers.values()))[0]["harder"]
    k = first["k"]
    metrics = (f"pass@{k}", f"mean@{k}", "distinct_answers")

    def cell(ci: tuple[float | None, float | None], spec: str = ".3f") -> str:
        return _cell(*ci, spec) + (" *" if ci[0] is not None and _excludes_zero(ci[0], ci[1]) else "")

    starts = [r["harder"]["start"] for runs in numbers.values() for r in runs]
    start = {m: _mean_ci_of_known([s.get(m) for s in starts]) for m in metrics}
    out: dict[str, Any] = {"k": k, "start": {m: {"mean": a, "ci95": b} for m, (a, b) in start.items()}, "arms": {}}
    lines = ["", f"Held-out problems with one operation more than any training problem ({first['end']['prompts']} "
             f"prompts, {k} samples each at T = {first['temperature']}; * marks a 95% interval that excludes 0):",
             "", f"| arm | pass@{k} | mean@{k} | answers per prompt | pass@{k} − start | pass@{k} − {baseline}'s | "
             f"mean@{k} − {baseline}'s |", "|---|---:|---:|---:|---:|---:|---:|",
             f"| start model | {_cell(*start[metrics[0]])} | {_cell(*start[metrics[1]])} | "
             f"{_cell(*start['distinct_answers'], '.2f')} | — | — | — |"]
    base = [r["harder"]["end"] for r in numbers.get(baseline, [])]
    for arm, runs in numbers.items():
        ends = [r["harder"]["end"] for r in runs]
        stats = {m: _mean_ci_of_known([e.get(m) for e in ends]) for m in metrics}
        change = _mean_ci_of_known([r["harder"]["end"][metrics[0]] - r["harder"]["start"][metrics[0]] for r in runs])
        gaps = {m: diff_ci([e[m] for e in ends], [b[m] for b in base]) for m in metrics[:2]} \
            if base and arm != baseline else {}
        out["arms"][arm] = {name: {"mean": a, "ci95": b} for name, (a, b) in
                            [*stats.items(), (f"{metrics[0]}_change", change),
                             *((f"{m}_gap", g) for m, g in gaps.items())]}
        gap_cells = [cell(g) for g in gaps.values()] or ["—", "—"]
        lines.append(f"| {arm} | {_cell(*stats[metrics[0]])} | {_cell(*stats[metrics[1]])} | "
                     f"{_cell(*stats['distinct_answers'], '.2f')} | {cell(change)} | " + " | ".join(gap_cells) + " |")
    if contrasts:
        lines.append("")
    for arm, other in contrasts:
        gaps = {m: diff_ci([r["harder"]["end"][m] for r in numbers[arm]],
                           [r["harder"]["end"][m] for r in numbers[other]]) for m in metrics[:2]}
        out["arms"][arm].update({f"{m}_gap_vs_{other}": {"mean": g[0], "ci95": g[1]} for m, g in gaps.items()})
        lines.append(f"- {arm} − {other}: " + ", ".join(f"{m} {cell(g)}" for m, g in gaps.items()) + ".")
    summary["harder"] = out
    return lines


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


def write_curves(numbers: dict[str, list[dict[str, Any]]], seeds: Sequence[Any], path: Path) -> Path:
    """Every run's curve as CSV (arm, seed, step, entropy, rollout_acc, control_value; empty where a run has no
    value): the data the study's figures are drawn from, small enough to commit beside the report."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "step", "entropy", "rollout_acc", "control_value"])
        for arm, runs in numbers.items():
            for seed, r in zip(seeds, runs, strict=True):
                for row in zip(r["steps"], r["entropy"], r["rollout_acc"], r["control_value"], strict=True):
                    w.writerow([arm, "" if seed is None else seed, row[0]]
                               + ["" if v is None else f"{v:.6g}" for v in row[1:]])
    return path


def target_holding(numbers: dict[str, list[dict[str, Any]]], target: float,
                   baseline: str = "grpo") -> tuple[list[str], dict[str, Any]]:
    """How close each arm holds the rollout entropy at ``target`` (nats/token): mean |H − target| over the second
    half of its steps and the share of those steps within 10% of the target (mean ± 95% CI across seeds), and per
    seed the first step within 10% ("never" if none). Markdown lines and a summary dict keyed by arm."""
    band = 0.1 * target
    lines = [f"How each arm holds the target {target:g} nats/token (second half of the steps; within 10% = "
             f"|H − {target:g}| ≤ {band:.3g}):", "",
             "| arm | mean abs(H − target) | second-half steps within 10% | first step within 10% (per seed) | "
             "mean H, second half |", "|---|---:|---:|---|---:|"]
    summary: dict[str, Any] = {"target": target, "arms": {}}
    errors_of: dict[str, list[float]] = {}
    shares_of: dict[str, list[float]] = {}
    for arm, runs in numbers.items():
        errors, shares, firsts, means = errors_of.setdefault(arm, []), shares_of.setdefault(arm, []), [], []
        for r in runs:
            steps, ent = r["steps"], r["entropy"]
            half = ent[len(ent) // 2:]
            errors.append(sum(abs(h - target) for h in half) / len(half))
            shares.append(sum(abs(h - target) <= band for h in half) / len(half))
            means.append(sum(half) / len(half))
            firsts.append(next((s for s, h in zip(steps, ent, strict=True) if abs(h - target) <= band), None))
        err, share, mean_h = mean_ci(errors), mean_ci(shares), mean_ci(means)
        summary["arms"][arm] = {"abs_error": {"mean": err[0], "ci95": err[1]},
                                "share_within_10pct": {"mean": share[0], "ci95": share[1]},
                                "second_half_entropy": {"mean": mean_h[0], "ci95": mean_h[1]},
                                "first_step_within_10pct": firsts}
        first_text = ", ".join("never" if f is None else str(f) for f in firsts)
        lines.append(f"| {arm} | {_cell(*err)} | {_cell(*share, '.2f')} | {first_text} | {_cell(*mean_h)} |")
    if baseline in numbers:
        lines.append("")
        for arm in numbers:
            if arm == baseline:
                continue
            gap, half_w = diff_ci(errors_of[arm], errors_of[baseline])
            summary["arms"][arm]["abs_error_gap"] = {"mean": gap, "ci95": half_w,
                                                     "excludes_zero": _excludes_zero(gap, half_w)}
            sgap, shalf = diff_ci(shares_of[arm], shares_of[baseline])
            summary["arms"][arm]["share_within_10pct_gap"] = {"mean": sgap, "ci95": shalf,
                                                              "excludes_zero": _excludes_zero(sgap, shalf)}
            verdict = "excludes" if _excludes_zero(gap, half_w) else "includes"
            sverdict = "excludes" if _excludes_zero(sgap, shalf) else "includes"
            lines.append(f"- {arm} − {baseline}, mean abs(H − target): {_cell(gap, half_w)} "
                         f"(the interval {verdict} 0); share within 10%: {_cell(sgap, shalf, '.2f')} "
                         f"(the interval {sverdict} 0).")
    return lines, summary


def best_controller(numbers: dict[str, list[dict[str, Any]]], holding: dict[str, Any]) -> str | None:
    """The arm with a target-entropy controller (its runs log ``entropy_control/value``) whose mean |H − target|
    over the second half is lowest (``holding``: ``target_holding``'s summary); None when no arm has one."""
    controlled = [a for a, runs in numbers.items() if all(any(v is not None for v in r["control_value"]) for r in runs)]
    if not controlled:
        return None
    return min(controlled, key=lambda a: (holding["arms"][a]["abs_error"]["mean"],
                                          -holding["arms"][a]["share_within_10pct"]["mean"]))


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


# ---------------------------------------------------------------- selection − random (configs/studies/selection.yaml)

METHOD_NAMES = {"kl_cov": "KL-Cov", "clip_cov": "Clip-Cov"}


def _run_value(key: str, harder: bool = False) -> Callable[[dict[str, Any]], Any]:
    """A run's ``key`` (from its end on the harder problems when ``harder``), or None where it has none."""
    return lambda r: (r["harder"]["end"] if harder else r).get(key)


def _selection_metrics(numbers: dict[str, list[dict[str, Any]]], pass_k: int) -> list[tuple[str, str, Any]]:
    """(key, label, value of a run) of what a selection contrast compares: the end entropy, pass@k and mean@k on
    the held-out prompts and, where every run has them, on the problems with one operation more."""
    out = [("entropy_end", "entropy at the end (nats/token)", _run_value("final_entropy")),
           (f"pass@{pass_k}", f"pass@{pass_k}, held-out prompts", _run_value(f"pass@{pass_k}")),
           (f"mean@{pass_k}", f"mean@{pass_k}, held-out prompts", _run_value(f"mean@{pass_k}"))]
    runs = [r for rs in numbers.values() for r in rs]
    if runs and all(r.get("harder") for r in runs):
        k = runs[0]["harder"]["k"]
        out += [(f"harder_{m}", f"{m}, one operation more", _run_value(m, harder=True))
                for m in (f"pass@{k}", f"mean@{k}")]
    return out


def _pair_stats(numbers, arm: str, control: str, value) -> dict[str, Any] | None:
    """Both arms' mean ± CI of ``value`` across seeds and their difference (Welch); None when a run lacks it."""
    vals = [[value(r) for r in numbers[x]] for x in (arm, control)]
    if any(v is None for vs in vals for v in vs):
        return None
    (ms, hs), (mc, hc), (d, hd) = mean_ci(vals[0]), mean_ci(vals[1]), diff_ci(vals[0], vals[1])
    return {"selection": {"mean": ms, "ci95": hs}, "random": {"mean": mc, "ci95": hc},
            "diff": {"mean": d, "ci95": hd, "excludes_zero": _excludes_zero(d, hd)}}


def _pair_label(pair: dict[str, Any]) -> str:
    return f"{METHOD_NAMES.get(pair['method'], pair['method'])} {pair['ratio']:g}, {pair['prompts']} prompts/step"


def selection_section(numbers: dict[str, list[dict[str, Any]]], pairs: Sequence[dict[str, Any]], pass_k: int,
                      summary: dict[str, Any]) -> list[str]:
    """The report's answer to "does choosing tokens by covariance matter?": per (selection arm, random control)
    pair, the tokens each selects per mini-batch and their overlap, each metric's selection − random with
    Welch's 95% interval, what the selected tokens are beside the random ones, and a paragraph that states
    which contrasts exclude 0. ``pairs``: dicts with arm, control, method, ratio, prompts (study.py). Records
    ``summary["selection"]``."""
    pairs = [p for p in pairs if p["arm"] in numbers and p["control"] in numbers]
    metrics = _selection_metrics(numbers, pass_k)
    entries = []
    for p in pairs:
        contrasts = {key: _pair_stats(numbers, p["arm"], p["control"], value) for key, _, value in metrics}
        tokens = {role: _mean_ci_of_known([r.get("selected_tokens") for r in numbers[p[role]]])
                  for role in ("arm", "control")}
        jaccard = _mean_ci_of_known([r.get("jaccard_vs_cov") for r in numbers[p["control"]]])
        entries.append({**p, "contrasts": {k: v for k, v in contrasts.items() if v is not None},
                        "tokens": {role: {"mean": m, "ci95": h} for role, (m, h) in tokens.items()},
                        "jaccard": {"mean": jaccard[0], "ci95": jaccard[1]}})
    summary["selection"] = entries
    summary["selection_labels"] = {key: label for key, label, _ in metrics}
    lines = ["", "## Selection − random, per ratio", "",
             "Each covariance-selected arm against its control on as many tokens chosen at random (KL-Cov: "
             "`algo.loss.cov_score=random`; Clip-Cov: `algo.loss.cov_score=random_matched`, uniform over all valid "
             "tokens). "
             "Tokens per mini-batch: the tokens selected per optimizer update (mean over steps, then ± across "
             "seeds). Jaccard: the control's tokens against what c_t would have picked on the same mini-batch, "
             "|R ∩ C| / |R ∪ C| pooled per step (0: disjoint, 1: the same tokens); two independent uniform picks of "
             "a fraction f of the tokens overlap by f / (2 − f) on average (chance, for KL-Cov's f = ratio). "
             "* marks a 95% interval that excludes 0.", "",
             "| selection | ratio | prompts/step | tokens per mini-batch, selection | tokens per mini-batch, random "
             "| Jaccard random vs c_t's pick | chance |", "|---|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        t = e["tokens"]
        chance = f"{e['ratio'] / (2 - e['ratio']):.3f}" if e["method"] == "kl_cov" else "—"
        lines.append(f"| {e['arm']} | {e['ratio']:g} | {e['prompts']} | "
                     f"{_cell(t['arm']['mean'], t['arm']['ci95'], '.1f')} | "
                     f"{_cell(t['control']['mean'], t['control']['ci95'], '.1f')} | "
                     f"{_cell(e['jaccard']['mean'], e['jaccard']['ci95'])} | {chance} |")
    for key, label, _ in metrics:
        rows = [_contrast_row(e, e["contrasts"][key]) for e in entries if key in e["contrasts"]]
        if rows:
            lines += ["", f"{label}:", "", "| selection | random control | ratio | prompts/step | selection | random "
                      "| selection − random |", "|---|---|---:|---:|---:|---:|---:|", *rows]
    lines += _composition_lines(numbers, entries)
    lines += ["", selection_paragraph(entries, {key: label for key, label, _ in metrics})]
    return lines


def _contrast_row(e: dict[str, Any], c: dict[str, Any]) -> str:
    d = c["diff"]
    diff = "—" if d["mean"] is None else f"{d['mean']:+.3f}" + ("" if d["ci95"] is None else f" ± {d['ci95']:.3f}")
    return (f"| {e['arm']} | {e['control']} | {e['ratio']:g} | {e['prompts']} | "
            f"{_cell(c['selection']['mean'], c['selection']['ci95'])} | "
            f"{_cell(c['random']['mean'], c['random']['ci95'])} | {diff}{' *' if d['excludes_zero'] else ''} |")


def _composition_lines(numbers: dict[str, list[dict[str, Any]]], entries: Sequence[dict[str, Any]]) -> list[str]:
    """What the selected tokens are, beside the random ones: share with A > 0, mean probability, mean relative
    position in the response (0: first token, 1: last), means over steps and seeds."""
    lines = ["", "What the tokens are (means over steps and seeds; position: 0 the response's first token, 1 its "
             "last):", "", "| arm | picked by | share with A > 0 | mean p | mean position |",
             "|---|---|---:|---:|---:|"]
    for e in entries:
        for role, how in (("arm", "c_t"), ("control", "random")):
            runs = numbers[e[role]]
            cells = []
            for key, spec in (("selected_pos_adv_share", ".2f"), ("selected_prob", ".3f"), ("selected_pos", ".2f")):
                m, _ = _mean_ci_of_known([r.get(key) for r in runs])
                cells.append("—" if m is None else f"{m:{spec}}")
            lines.append(f"| {e[role]} | {how} | " + " | ".join(cells) + " |")
    return lines


def selection_paragraph(entries: Sequence[dict[str, Any]], labels: dict[str, str]) -> str:
    """A paragraph, generated from the numbers, that states which selection − random contrasts exclude 0."""
    total = sum(len(e["contrasts"]) for e in entries)
    if not entries or not total:
        return "No selection − random contrast could be computed (no pair of arms with numbers)."
    if all(c["diff"]["ci95"] is None for e in entries for c in e["contrasts"].values()):
        return (f"With one seed per arm there are no intervals, so none of the {total} selection − random "
                "contrasts can be said to exclude 0.")
    hits = [f"{_pair_label(e)}: {labels[key]} {c['diff']['mean']:+.3f} ± {c['diff']['ci95']:.3f}"
            for e in entries for key, c in e["contrasts"].items() if c["diff"]["excludes_zero"]]
    text = (f"Of the {total} selection − random contrasts, " + (
        f"{len(hits)} exclude{'s' if len(hits) == 1 else ''} 0: " + "; ".join(hits) + ". The others include 0."
        if hits else "none excludes 0: at this scale and with these seeds, choosing the tokens by covariance is "
        "not measurably different from choosing as many at random."))
    overlaps = [(e, e["jaccard"]["mean"]) for e in entries if e["jaccard"]["mean"] is not None]
    if overlaps:
        text += " The random controls overlap c_t's pick with a Jaccard index of " + ", ".join(
            f"{j:.2f} ({_pair_label(e)})" for e, j in overlaps) + "."
    return text


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
