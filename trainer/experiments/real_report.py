"""The report of `make demo-real` (experiments/demo_real.py): the level scan, the runs' entropy and accuracy with
the entropy law's fit (experiments/report.py's table and plots), pass@8 and answers per prompt before and after,
and plain statements of what held; every number also in ``demo_real.json``."""

from __future__ import annotations

import json
from pathlib import Path


def scan_lines(facts: dict) -> list[str]:
    k = facts["k"]
    lo, hi = facts["band"]
    lines = [f"Start model on each level ({next(iter(facts['scan'].values()))['prompts']} prompts, {k} samples "
             f"each at T = {facts['temperature']}):", "",
             f"| level | operand digits | operations | pass@{k} | mean@{k} | answers per prompt |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in facts["scan"].items():
        digits, ops = name[1:].split("o")
        mark = " (trained)" if name == facts["level"] else ""
        da = r.get("distinct_answers")
        lines.append(f"| {name}{mark} | {digits} | {ops} | {r[f'pass@{k}']:.3f} | {r[f'mean@{k}']:.3f} | "
                     f"{'—' if da is None else f'{da:.2f}'} |")
    why = ("named with --level" if facts.get("level_given") else
           f"the level whose pass@{k} lies in [{lo}, {hi}] nearest 0.5")
    lines += ["", f"Trained on {facts['level']}, {why}: in such a level a group of {k} rollouts often holds both "
              "right and wrong answers, so GRPO has a signal, and there is room both to rise and to collapse."]
    return lines


def before_after_lines(facts: dict) -> list[str]:
    k = facts["k"]
    s = facts["start"]
    lines = [f"Validation problems ({s['prompts']} prompts of {facts['level']}), {k} samples each at "
             f"T = {facts['temperature']}, before and after:", "",
             f"| model | pass@{k} | mean@{k} | answers per prompt |", "|---|---:|---:|---:|"]
    rows = [("start model", s)] + [(a, r) for a, r in facts["end"].items()]
    for name, r in rows:
        da = r.get("distinct_answers")
        lines.append(f"| {name} | {r[f'pass@{k}']:.3f} | {r[f'mean@{k}']:.3f} | {'—' if da is None else f'{da:.2f}'} |")
    return lines


def verdict_lines(summaries: list[dict], facts: dict) -> list[str]:
    """What held and what did not, read off the numbers (whatever they are)."""
    by = {s["name"]: s for s in summaries}
    k = facts["k"]
    lines = []
    g = by.get("grpo")
    if g and g["final_entropy"] is not None:
        h0, h1 = g["first_entropy"], g["final_entropy"]
        lines.append(f"- GRPO's entropy went {h0:.3f} → {h1:.3f} nats/token ({h1 / h0:.2f}× its start: "
                     f"{'collapsed' if h1 < 0.5 * h0 else 'did not collapse'} by the below-half yardstick; end = "
                     "mean of the last 10% of steps).")
        for name in ("clip_cov", "kl_cov"):
            s = by.get(name)
            if s and s["final_entropy"] is not None and h1 > 0:
                r = s["final_entropy"] / h1
                lines.append(f"- {name}: end entropy {s['final_entropy']:.3f} = {r:.2f}× GRPO's "
                             f"({'higher' if r > 1.1 else 'not clearly higher'}).")
    start = facts["start"]
    for name, r in facts["end"].items():
        lines.append(f"- {name}: pass@{k} {start[f'pass@{k}']:.3f} → {r[f'pass@{k}']:.3f}, mean@{k} "
                     f"{start[f'mean@{k}']:.3f} → {r[f'mean@{k}']:.3f}, answers per prompt "
                     f"{_num(start.get('distinct_answers'))} → {_num(r.get('distinct_answers'))}.")
    for s in summaries:
        law = s["law"]
        if law is not None:
            sign = "" if law.a > 0 else " (a ≤ 0: accuracy rose with entropy, not the law's shape)"
            lines.append(f"- {s['name']}: R = −a·e^H + b with a = {law.a:.3g}, b = {law.b:.3g} fits its "
                         f"{len(s['law_points'])} evaluations with R² = {law.r2:.2f} (ceiling b − a = "
                         f"{law.ceiling:.3f}){sign}.")
        else:
            lines.append(f"- {s['name']}: no law fit ({s['law_error']}).")
    return lines


def _num(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def write_real_report(run_dirs: list[Path], out: Path, facts: dict) -> Path:
    """``<out>/report.md`` with the plots of experiments/report.py, and ``<out>/demo_real.json``."""
    from fastcov.trainer.experiments.report import write_report

    sz, sec = facts["sizes"], facts["seconds"]
    pre = "\n".join([
        f"Model: {Path(facts['model']).name} (GGUF, dequantized to fp32, converted once in {sec['convert']:.0f}s). "
        f"CPU: {facts['cpu']}; {facts['threads']} torch thread(s) per run, {facts['jobs']} run(s) at once.",
        "",
        f"Size: {sz['prompts_per_step']} prompts × {sz['rollouts']} rollouts per step, responses up to "
        f"{sz['max_new_tokens']} tokens, {sz['mini_batches']} optimizer steps per rollout batch, "
        f"{sz['max_steps']} steps, lr {sz['lr']:g}; config `{facts['config']}`"
        + (f" with {' '.join(facts['overrides'])}" if facts["overrides"] else "") + ".",
        f"Wall time {sec['total']:.0f}s: level scan {sec['scan']:.0f}s, "
        + ", ".join(f"{a} {s:.0f}s" for a, s in facts["timings"].items())
        + f", evaluation {sec['evaluate']:.0f}s.",
        "", *scan_lines(facts), "", *before_after_lines(facts), ""])
    title = f"fastcov demo-real: GRPO vs Clip-Cov vs KL-Cov on {Path(facts['model']).stem}"
    report, summaries = write_report(run_dirs, out, title, pre)
    verdict = verdict_lines(summaries, facts)
    table = "\n| run | entropy first"
    report.write_text(report.read_text().replace(table, "\n" + "\n".join(verdict) + "\n" + table, 1))
    laws = {s["name"]: (None if s["law"] is None else {"a": s["law"].a, "b": s["law"].b, "r2": s["law"].r2,
                                                       "ceiling": s["law"].ceiling}) for s in summaries}
    runs = {s["name"]: {"first_entropy": s["first_entropy"], "final_entropy": s["final_entropy"],
                        "entropy": s["entropy"], "reward": s["reward"], "eval_steps": s["eval_steps"],
                        "val_acc": s["val_acc"], "law": laws[s["name"]]} for s in summaries}
    (out / "demo_real.json").write_text(json.dumps({**facts, "runs": runs, "verdict": verdict}, indent=1) + "\n")
    return report
