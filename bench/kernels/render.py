"""The kernel benchmark's results: the day's JSON and markdown per device (``write_results``), and the JSON
lines, one per case as it finishes, with their markdown (``case_line``, ``render_jsonl_md``)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import _measure as M
from bench._common import fmt


def _check_cell(c: dict) -> str:
    ch = c.get("check")
    if not ch:
        return "—"
    s = f"{ch['logprob_max_abs']:.1e}"
    s += f" / {ch['entropy_max_abs']:.1e}" if "entropy_max_abs" in ch else " / n.a."
    if not ch.get("finite", True) or ch.get("logprob_max", 0.0) > 1e-6:
        s += " ⚠"
    return s


def render_md(doc: dict) -> str:
    lines = [f"# fastcov kernel benchmark — {doc['device_name']} — {doc['date']}", ""]
    for run in doc["runs"]:
        env = run["env"]
        lines += [
            f"## Preset `{run['preset']}`", "",
            f"- command: `{run['command']}`",
            f"- device: {env.get('device_name')}"
            + (f", CUDA {env.get('cuda')}, capability {env.get('capability')}" if env.get("device") == "cuda" else ""),
            f"- torch {env.get('torch')}, triton {env.get('triton')}, python {env.get('python')}; "
            f"torch intra-op threads {run.get('threads', env.get('torch_threads'))}; "
            f"host CPU {env.get('host_cpu')} ({env.get('host_cores')} cores)",
            f"- dtype {run['dtype']}, temperature {run['temperature']}, "
            + ("timing interleaved in one process per shape, memory in a fresh process per case; "
               if run["isolated"] else "all cases in one process, one implementation after the other; ")
            + f"started {run['started']}, wall time {run['wall_s']:.1f} s",
            "",
        ]
        mm = run["matmul"]
        lines += ["Plain matmul rate measured in this run (`hidden @ weight[:Vc].T` on the benchmark's inputs"
                  + (", timed in the same round-robin as the implementations" if run["isolated"] else "")
                  + "):", "",
                  "| group | N | D | Vc | ms | TFLOP/s |", "|---|---:|---:|---:|---:|---:|"]
        for m in mm.values():
            lines.append(f"| {m['group']} | {m.get('n', '—')} | {m.get('d', '—')} | {m.get('v_chunk', '—')} | "
                         f"{fmt(m.get('ms'), '.3f')} | {fmt(m.get('tflops'), '.3f')} |")
        lines.append("")
        for grp in run["groups"]:
            gcases = [c for c in run["cases"] if c["group"] == grp["name"]]
            lines += [f"### {grp['name']}: D = {grp['d']}, V = {grp['v']}, {grp['dtype']} "
                      f"(warm-up {grp['warmup']}, median of {grp['repeats']})", ""]
            if grp.get("note"):
                lines += [f"_{grp['note']}_", ""]
            lines += [
                "| N | impl | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | % of matmul (fwd / fwd+bwd) "
                "| peak mem fwd | peak mem fwd+bwd | speed × naive (fwd / fwd+bwd) "
                "| mem ÷ naive (fwd / fwd+bwd) | max abs err logp / H vs fp64 |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for c in gcases:
                if c["status"] == "unavailable":
                    lines.append(f"| {c['n']} | {c['impl']} | unavailable: {c['reason']} "
                                 "| — | — | — | — | — | — | — | — |")
                    continue
                fwd = fmt(c.get("fwd_ms"), ".2f")
                if c["status"] != "ok":
                    tag = "OOM" if c["status"] == "OOM" else "error"
                    fwd = f"{fwd} ({tag}: {c['reason']})" if c.get("fwd_ms") is not None else f"{tag}: {c['reason']}"
                lines.append(
                    f"| {c['n']} | {c['impl']} | {fwd} | {fmt(c.get('fb_ms'), '.2f')} "
                    f"| {fmt(c.get('fb_tflops'), '.3f')} "
                    f"| {fmt(c.get('fwd_pct_matmul'), '.0f', '%')} / {fmt(c.get('fb_pct_matmul'), '.0f', '%')} "
                    f"| {M.fmt_bytes(c.get('fwd_peak_bytes'))} | {M.fmt_bytes(c.get('fb_peak_bytes'))} "
                    f"| {fmt(c.get('speedup_fwd'), '.2f', '×')} / {fmt(c.get('speedup_fb'), '.2f', '×')} "
                    f"| {fmt(c.get('mem_ratio_fwd'), '.3f')} / {fmt(c.get('mem_ratio_fb'), '.3f')} "
                    f"| {_check_cell(c)} |")
            lines.append("")
    lines += [
        "## How to read this", "",
        "- fwd: forward under `torch.no_grad()` (the old/ref log-prob pass). fwd+bwd: forward, then "
        "`autograd.grad` of Σ g·logprob + e·entropy (g, e random) w.r.t. hidden and weight; for the "
        "logprob-only peers (liger, cce) the entropy term is absent, so they do less work than asked of the rest.",
        "- TFLOP/s are effective: 2·N·D·V for fwd and 8·N·D·V for fwd+bwd (forward, recompute, dh, dW) "
        "whatever the implementation actually executes; % of matmul divides them by the plain matmul "
        "rate measured above at the same N and D, so 100% is the floor the design targets.",
        "- speed × naive: naive's median time ÷ this one's (>1 is faster); mem ÷ naive: this peak ÷ naive's "
        "(<1 is leaner). Both are measured in the same run at the same N.",
        "- peak mem: the increment over what was allocated before the call (inputs excluded; outputs, "
        "saved activations, gradients of hidden and weight included). CUDA: max_memory_allocated; "
        "CPU: peak RSS of a fresh process per case with glibc's mmap threshold pinned at 64 KiB "
        "(VmHWM reset through /proc/self/clear_refs), so it follows live tensor memory.",
        "- max abs err: the first rows' log-prob / entropy against a float64 recomputation from the same "
        "inputs (n.a.: the implementation returns no entropy); ⚠ marks a positive log-prob or a non-finite value.",
        "- unavailable rows: the implementation is absent or cannot run on this device; OOM: it ran out of memory.",
        "",
    ]
    return "\n".join(lines)


def write_results(run: dict, out_dir: Path, env: dict, date: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{env['device_slug']}-{date}"
    jpath, mpath = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    runs = []
    if jpath.exists():  # keep the other presets run on this device today
        try:
            runs = [r for r in json.loads(jpath.read_text()).get("runs", []) if r.get("preset") != run["preset"]]
        except (json.JSONDecodeError, OSError):
            runs = []
    runs.append(run)
    doc = {"schema": 1, "device_slug": env["device_slug"], "device_name": env["device_name"], "date": date,
           "runs": runs}
    jpath.write_text(json.dumps(doc, indent=1) + "\n")
    mpath.write_text(render_md(doc))
    return jpath, mpath


# =========================================================================== JSON lines


JSONL_KEYS = ("impl", "group", "n", "d", "v", "dtype", "status", "reason", "entropy",
              "fwd_ms", "fb_ms", "fwd_tflops", "fb_tflops", "fwd_pct_floor", "fb_pct_floor",
              "fwd_pct_matmul", "fb_pct_matmul", "fwd_peak_bytes", "fb_peak_bytes", "mem_method",
              "speedup_fwd", "speedup_fb", "mem_ratio_fwd", "mem_ratio_fb", "check", "autotune")


def jsonl_path(out_dir: Path, env: dict, date: str) -> Path:
    """<out>/<device slug>/kernels-<date>.jsonl: one line per case, appended as each finishes."""
    return out_dir / env["device_slug"] / f"kernels-{date}.jsonl"


def case_line(case: dict, preset: str, matmul: dict, env: dict, command: str, date: str) -> dict:
    """A self-contained JSON line: the case, its shape's cuBLAS floor, the device and the versions."""
    floor = (matmul.get(f'{case["group"]}/{case["n"]}') or {}).get("floor") or {}
    return {"preset": preset, "date": date, "device": env.get("device_name"), "torch": env.get("torch"),
            "triton": env.get("triton"), "cuda": env.get("cuda"), "command": command,
            **{k: case.get(k) for k in JSONL_KEYS},
            "floor_fwd_ms": floor.get("fwd_ms"), "floor_fb_ms": floor.get("fb_ms"),
            "floor_fb_tflops": floor.get("fb_tflops"), "floor_error": floor.get("error")}


def read_jsonl(path: Path) -> list[dict]:
    """The lines of a results file; a torn last line (a run killed mid-write) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def render_jsonl_md(rows: list[dict]) -> str:
    """Markdown tables (one per preset and shape group) from JSON lines; the last line of a case wins."""
    latest: dict[tuple, dict] = {}
    for r in rows:
        latest[(r["preset"], r["group"], r["n"], r["impl"])] = r
    if not latest:
        return "# fastcov kernel benchmark\n\n(no cases)\n"
    first = next(iter(latest.values()))
    lines = [f"# fastcov kernel benchmark — {first.get('device')}", "",
             f"torch {first.get('torch')}, triton {first.get('triton')}, CUDA {first.get('cuda')}; "
             f"`{first.get('command')}` ({first.get('date')}).", "",
             "% of floor: the same-run cuBLAS chain's time (fwd: H·Wᵀ; fwd+bwd: H·Wᵀ twice, dZ·W, dZᵀ·H, "
             "8·N·D·V FLOPs, token chunks of ≤ 1 GiB of logits) ÷ this implementation's time. "
             "Peak memory: the increment over the inputs (outputs and gradients included).", ""]
    groups: dict[tuple, list[dict]] = {}
    for r in latest.values():
        groups.setdefault((r["preset"], r["group"], r["d"], r["v"], r["dtype"]), []).append(r)
    for (preset, group, d, v, dtype), rs in groups.items():
        lines += [f"## {preset} / {group}: D = {d}, V = {v}, {dtype}", "",
                  "| N | impl | fwd ms | fwd TFLOP/s | fwd % of floor | fwd+bwd ms | fwd+bwd TFLOP/s "
                  "| fwd+bwd % of floor | peak mem fwd+bwd | speed × naive (fwd+bwd) | max abs err logp / H |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(rs, key=lambda r: r["n"]):
            if r["status"] not in ("ok",) and r.get("fb_ms") is None and r.get("fwd_ms") is None:
                lines.append(f"| {r['n']} | {r['impl']} | {r['status']}: {r['reason']} "
                             "| — | — | — | — | — | — | — | — |")
                continue
            lines.append(
                f"| {r['n']} | {r['impl']} | {fmt(r.get('fwd_ms'), '.2f')} | {fmt(r.get('fwd_tflops'), '.3g')} "
                f"| {fmt(r.get('fwd_pct_floor'), '.0f', '%')} | {fmt(r.get('fb_ms'), '.2f')} "
                f"| {fmt(r.get('fb_tflops'), '.3g')} | {fmt(r.get('fb_pct_floor'), '.0f', '%')} "
                f"| {M.fmt_bytes(r.get('fb_peak_bytes'))} | {fmt(r.get('speedup_fb'), '.2f', '×')} "
                f"| {_check_cell(r)} |")
        floors = {r["n"]: r for r in rs if r.get("floor_fb_ms")}
        if floors:
            lines += ["", "cuBLAS floor: " + "; ".join(
                f"N {n}: fwd {r['floor_fwd_ms']:.2f} ms, fwd+bwd {r['floor_fb_ms']:.2f} ms "
                f"({r['floor_fb_tflops']:.3g} TFLOP/s)" for n, r in sorted(floors.items()))]
        lines.append("")
    return "\n".join(lines)
