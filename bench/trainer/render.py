"""The results: TRL's ÷ fastcov's ratios per case, the held-out rewards, the markdown table."""

from __future__ import annotations

import os

from bench.trainer.presets import CASE_NAMES, CASES


def load_note() -> str:
    try:
        la = os.getloadavg()
    except OSError:
        return "unknown"
    return f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} cores"


def ratios(rows: list[dict]) -> list[dict]:
    """Per case, each other arm that ran against fastcov's trainer (the last line of each in ``rows``)."""
    out = []
    for case in CASES:
        got = {r["trainer"]: r for r in rows if r["case"] == case and r.get("status", "ok") == "ok"}
        base = got.get("fastcov")
        for name in CASES[case][1:]:
            other = got.get(name)
            if base and other:
                out.append(ratio(case, base, other))
    return out


def ratio(case: str, base: dict, other: dict) -> dict:
    """``other``'s times over fastcov's ``base`` (speed-ups), fastcov's tokens/s and peak RSS over ``other``'s."""
    return {"case": case, "case_name": CASE_NAMES[case], "vs": other["trainer"],
            "speedup": other["step_s"] / base["step_s"],
            "rollout": other["rollout_s"] / max(base["rollout_s"], 1e-9),
            "logprob": other["logprob_s"] / max(base["logprob_s"], 1e-9) if base["logprob_s"] else None,
            "update": other["update_s"] / max(base["update_s"], 1e-9),
            "tokens_per_s": base["tokens_per_s"] / max(other["tokens_per_s"], 1e-9),
            "peak_rss": base["peak_rss_mb"] / max(other["peak_rss_mb"], 1e-9)}


def held_out(r: dict, which: str = "eval") -> str:
    """``<which>_before`` → ``<which>_after`` (mean reward ± binomial standard error; ``eval``: the held-out
    prompts, ``pool``: the training pool), "—" in lines without them."""
    b, a = r.get(f"{which}_before"), r.get(f"{which}_after")
    if not b or not a:
        return "—"
    return f"{b['mean']:.3f} → {a['mean']:.3f} ({a['mean'] - b['mean']:+.3f}, SE {a['se']:.3f})"


def render(rows: list[dict]) -> str:
    """Markdown: one row per trainer and case (medians per rollout batch), then the ratios."""
    out = ["| case | trainer | s / optimizer step | rollout s | old log-prob s | update s | tokens/s | peak RSS MB "
           "| RSS growth in training MB | reward first → last (mean 1st half → 2nd half) | training pool before → "
           "after | held-out before → after |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        if r.get("status", "ok") != "ok":
            out.append(f"| {r['case']} {r['case_name']} | {r['trainer']} | did not run: "
                       f"{r['error'].splitlines()[0][:160].replace('|', '/')} ({r['where']}) |" + " — |" * 9)
            continue
        out.append(f"| {r['case']} {r['case_name']} | {r['trainer']} | {r['step_s']:.3f} | {r['rollout_s']:.2f} | "
                   f"{r['logprob_s']:.2f} | {r['update_s']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} | "
                   f"{r['train_rss_mb'] or 0:.0f} | {r['reward_first']:.3f} → {r['reward_last']:.3f} "
                   f"({r['reward_first_half']:.3f} → {r['reward_second_half']:.3f}) | {held_out(r, 'pool')} | "
                   f"{held_out(r)} |")
    out += ["", "| case | against | speed-up (its s/step ÷ fastcov's) | rollout | old log-prob | update | "
            "fastcov peak RSS ÷ its |", "|---|---|---:|---:|---:|---:|---:|"]
    for q in ratios(rows):
        lp = "—" if q["logprob"] is None else f"{q['logprob']:.2f}×"
        out.append(f"| {q['case']} {q['case_name']} | {q['vs']} | {q['speedup']:.2f}× | {q['rollout']:.2f}× | {lp} | "
                   f"{q['update']:.2f}× | {q['peak_rss']:.2f} |")
    return "\n".join(out)
