"""The selection study's section of the report: each selection against its random controls (matched in
count and in composition), per metric the gap with its interval, and the paragraph that reads them."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastcov.trainer.experiments.student_t import _cell, _excludes_zero, _mean_ci_of_known, diff_ci, mean_ci

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
