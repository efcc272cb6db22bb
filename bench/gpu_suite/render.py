"""The suite's summary: the markdown written next to the JSONL after each part, and the table printed last."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_suite.presets import PARTS_ORDER
from bench.kernels import read_jsonl


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") or "—"


def render_md(rows: list[dict], source: str = "") -> str:
    """The summary: the last environment record, then per part the rows of the last run that ran it."""
    envs = [r for r in rows if r.get("part") == "env"]
    env = envs[-1] if envs else None
    lines = [f"# GPU validation suite — {(env or {}).get('gpu_name') or 'CPU'} — {(env or {}).get('at', '')[:10]}",
             ""]
    if env:
        lines += [f"Environment: {_cell(env.get('summary'))}.", "", f"Command: `{env.get('command')}`; commit "
                  f"{env.get('commit') or 'unknown'}." + (f" Rows: `{source}`." if source else ""), ""]
    for part in ("setup", *PARTS_ORDER):
        mine = [r for r in rows if r.get("part") == part]
        if not mine:
            continue
        last = [r for r in mine if r.get("run") == mine[-1].get("run")]
        lines += [f"## {part}", "", f"run {last[0].get('run')}, size {last[0].get('size')}", "",
                  "| measurement | status | result |", "|---|---|---|"]
        for r in last:
            text = r.get("summary") if r["status"] == "ok" else "; ".join(
                x for x in (r.get("reason"), r.get("summary")) if x)
            lines.append(f"| {_cell(r['name'])} | {r['status']} | {_cell(text)} |")
        lines.append("")
    return "\n".join(lines)


def write_md(jsonl: Path) -> Path:
    md = jsonl.with_suffix(".md")
    md.write_text(render_md(read_jsonl(jsonl) if jsonl.is_file() else [], str(jsonl)))
    return md


def print_table(rows: list[dict], width: int = 100) -> None:
    body = [(r["part"], r["name"], r["status"], " ".join(str(r.get("summary") if r["status"] == "ok" else
                                                             (r.get("reason") or r.get("summary"))).split()))
            for r in rows if r["part"] != "env"]
    w = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(("part", "measurement", "status"))]
    print(f"{'part':<{w[0]}}  {'measurement':<{w[1]}}  {'status':<{w[2]}}  result")
    for part, name, status, text in body:
        print(f"{part:<{w[0]}}  {name:<{w[1]}}  {status:<{w[2]}}  {text[:width] + ('…' if len(text) > width else '')}")
