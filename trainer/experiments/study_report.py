"""Statistics and the report of a multi-seed study: mean ± 95% confidence intervals across seeds, the
gap between two arms with its interval, entropy curves with bands, and the entropy law tested as the
paper tests it (fit on the first 15% of GRPO's steps, predict the rest).

Intervals use Student's t with n − 1 degrees of freedom (Welch's for a difference of two arms; student_t.py);
with 3 seeds they are wide, and the report says so rather than hiding it. The plots are in study_plots.py, the
selection study's section in study_selection.py; their names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

# t_cdf, t_quantile (student_t.py), the plots (study_plots.py) and the selection section (study_selection.py) left
# this module; re-exported (``X as X``) for the code that imports them from here
from fastcov.trainer.experiments.student_t import _cell, _excludes_zero, _mean_ci_of_known, diff_ci, mean_ci
from fastcov.trainer.experiments.student_t import t_cdf as t_cdf
from fastcov.trainer.experiments.student_t import t_quantile as t_quantile
from fastcov.trainer.experiments.study_plots import plot_bands as plot_bands
from fastcov.trainer.experiments.study_plots import plot_harder as plot_harder
from fastcov.trainer.experiments.study_plots import plot_headline as plot_headline
from fastcov.trainer.experiments.study_plots import plot_selection as plot_selection
from fastcov.trainer.experiments.study_plots import plot_target as plot_target
from fastcov.trainer.experiments.study_selection import METHOD_NAMES as METHOD_NAMES
from fastcov.trainer.experiments.study_selection import selection_paragraph as selection_paragraph
from fastcov.trainer.experiments.study_selection import selection_section as selection_section

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
