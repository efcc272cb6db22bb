"""The kernel parts: correctness (bench/correctness_gpu.py's cases), kernels (``python -m bench.kernels``
and the autotuner's picks beside the compile report's predictions), pytest (``pytest -m gpu``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from bench import _measure as M
from bench._common import fmt as _fmt
from bench.gpu_suite.presets import COMPILE_REPORT, CORRECTNESS, GPU_TEST_FILES, KERNEL_RUNS, REPO
from bench.gpu_suite.runner import Suite, guarded
from bench.kernels import jsonl_path as kernels_jsonl_path
from bench.kernels import read_jsonl, render_jsonl_md

# =========================================================================== part: correctness


def part_correctness(s: Suite) -> None:
    """correctness_gpu's cases at each head of CORRECTNESS[size]; on CPU only in the rehearsal (the Triton path
    under the interpreter)."""
    if not torch.cuda.is_available() and s.size != "rehearse":
        s.record("correctness", "correctness_gpu", "unavailable", "needs CUDA")
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for head in CORRECTNESS[s.size]:
        guarded(s, "correctness", "correctness_gpu", lambda s, head=head: correctness_cases(s, device, tuple(head)))


def correctness_cases(s: Suite, device: torch.device | None = None, extra: tuple[str, ...] = ()) -> None:
    """bench/correctness_gpu.py's cases through its own functions, one row per (case, implementation).
    ``device`` (default CUDA) and ``extra`` (correctness_gpu options: the shape, impls, temperatures) let the
    rehearsal and a CPU test drive it."""
    from bench import correctness_gpu as C

    argv = ["--out", str(s.scratch)] + list(extra)
    args = C.parse_args(argv)
    device = device or torch.device("cuda")
    if device.type == "cuda":
        C.check_environment(args.impls)
    dtype = getattr(torch, args.dtype)
    report = C.report_header(args, argv, s.gpu or "cpu")
    cases = [(t, False) for t in args.temperatures] + ([] if args.no_bias_case else [(args.temperatures[-1], True)])
    for ci, (temperature, with_bias) in enumerate(cases):
        if s.part_left() <= 0:
            s.record("correctness", f"T={temperature}" + (" bias" if with_bias else ""), "not reached",
                     "the part's time cap or the run's --budget is spent")
            continue
        case = C.build_case(args, ci, temperature, with_bias, dtype, device)
        for impl in args.impls:
            entry = C.check_impl(impl, case)
            report["cases"].append(entry)
            record_correctness_case(s, entry, args)
            torch.cuda.empty_cache()
        del case
        torch.cuda.empty_cache()
    fused = [e for e in report["cases"] if not e["baseline_only"]]
    ran = len(fused) == len(cases) * len([i for i in args.impls if i != "naive"])
    report["passed"] = ran and all(e["status"] == "ok" and not e.get("failures") for e in fused)
    path = C.write_report(report, s.scratch, s.gpu or "cpu")
    s.record("correctness", "correctness_gpu", "ok" if report["passed"] else "fail",
             "" if ran else "not every case ran",
             summary=f"{sum(e['status'] == 'ok' and not e.get('failures') for e in fused)}/{len(fused)} fastcov "
                     f"cases within tolerance (N {args.n}, D {args.d}, V {args.v}, {args.dtype})",
             report=str(path), shape={"n": args.n, "d": args.d, "v": args.v, "dtype": args.dtype})


def record_correctness_case(s: Suite, entry: dict, args) -> None:
    name = f"{entry['impl']} T={entry['temperature']}" + (" bias" if entry["bias"] else "")
    if entry["status"] != "ok":
        s.record("correctness", name, entry["status"], entry.get("reason", ""), impl=entry["impl"])
        return
    m = entry["errors"]
    errs = {q: m[q]["max_abs" if q in ("logprob", "entropy") else "max_rel"] for q in m}
    status = "ok" if entry["baseline_only"] or entry["passed"] else "fail"
    summary = (f"logp {errs['logprob']:.1e}, H {errs['entropy']:.1e}, dh rel {errs['dhidden']:.1e}, "
               f"dW rel {errs['dweight']:.1e}" + (f", db rel {errs['dbias']:.1e}" if "dbias" in errs else "")
               + f" ({entry['seconds_fwd_bwd']:.2f} s)" + (" baseline, no tolerance" if entry["baseline_only"] else ""))
    s.record("correctness", name, status, "; ".join(entry["failures"]), summary, impl=entry["impl"],
             temperature=entry["temperature"], bias=entry["bias"], max_errors=errs, invariants=entry["invariants"],
             seconds_fwd_bwd=entry["seconds_fwd_bwd"], shape={"n": args.n, "d": args.d, "v": args.v})


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)\b")


def pytest_counts(output: str) -> dict[str, int]:
    """{"passed": 3, "deselected": 500, ...} from pytest's last summary line ("error" counted as "errors")."""
    for line in reversed(output.splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found and (" in " in line or line.startswith("=")):
            counts: dict[str, int] = {}
            for n, what in found:
                key = {"error": "errors", "warning": "warnings"}.get(what, what)
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return {}


def part_pytest(s: Suite) -> None:
    """``pytest -m gpu`` on GPU_TEST_FILES (named files: collecting all of tests/ costs ~20 s)."""
    gpu_pytest(s, GPU_TEST_FILES)


def gpu_pytest(s: Suite, targets: tuple[str, ...] = GPU_TEST_FILES) -> None:
    """``FASTCOV_POISON=1 pytest -m gpu -q`` on ``targets`` in a subprocess: counts, the failing tests, the output's
    tail. A run in which no test passed is no pass: ``unavailable`` without CUDA (the tests skip), else ``fail``."""
    missing = [t for t in targets if not (REPO / t.split("::")[0]).exists() and not Path(t).exists()]
    if missing:
        s.record("pytest", "pytest -m gpu", "error", f"no such test file: {missing[0]}")
        return
    proc = s.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider", *targets],
                 {"FASTCOV_POISON": "1"})
    counts = pytest_counts(proc.out)
    failed = [ln for ln in proc.out.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    if proc.timed_out:
        status, reason = "timeout", proc.tail(3)
    elif counts.get("failed") or counts.get("errors"):
        status, reason = "fail", "; ".join(failed[:5])
    elif proc.rc not in (0, 5):
        status, reason = "error", f"pytest exited {proc.rc}: " + proc.tail(3)
    elif not counts.get("passed"):
        status, reason = (("fail", "no GPU test ran") if torch.cuda.is_available()
                          else ("unavailable", "needs CUDA (the GPU tests skip)"))
    else:
        status, reason = "ok", ""
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) + f" ({proc.wall_s:.0f} s)"
    s.record("pytest", "pytest -m gpu", status, reason, summary, counts=counts, returncode=proc.rc,
             targets=list(targets), failed=failed[:50], tail=proc.tail(30), wall_s=proc.wall_s)


# =========================================================================== part: kernels


def part_kernels(s: Suite) -> None:
    """``python -m bench.kernels`` for each of KERNEL_RUNS[size] (fastcov and naive first, then the peers), each
    case line appended to the kernels JSONL as its shape finishes; then the autotuner's picks."""
    for name, preset, extra in KERNEL_RUNS[s.size]:
        kernels_run(s, "kernels", name, preset, extra)
    record_autotune(s, "kernels")


def kernels_jsonl(s: Suite) -> Path:
    if s.flat:
        return s.out / "kernels.jsonl"
    cuda = torch.cuda.is_available()
    return kernels_jsonl_path(s.out, {"device_slug": M.device_slug(torch.device("cuda" if cuda else "cpu"))}, s.date)


def kernels_run(s: Suite, part: str, name: str, preset: str, extra: list[str]) -> None:
    """One ``bench.kernels`` subprocess: a row with its cases' statuses and fastcov's figures. The row fails when
    any fastcov case is not ok (an unavailable or missing Triton path is no pass)."""
    from bench.kernels import PRESETS

    cuda = torch.cuda.is_available()
    if PRESETS[preset]["device"] == "cuda" and not cuda:
        s.record(part, f"{name}: preset {preset}", "unavailable", "needs CUDA (--size smoke runs the smoke preset)")
        return
    lines = kernels_jsonl(s)
    before = len(read_jsonl(lines)) if lines.is_file() else 0
    proc = s.run([sys.executable, "-m", "bench.kernels", "--preset", preset, "--out", str(s.scratch),
                  "--jsonl", str(lines), *extra])
    cases = read_jsonl(lines)[before:] if lines.is_file() else []
    if lines.is_file():  # bench.kernels writes it at the end of a preset; a run stopped on its cap does not
        lines.with_suffix(".md").write_text(render_jsonl_md(read_jsonl(lines)))
    statuses: dict[str, int] = {}
    for c in cases:
        statuses[c["status"]] = statuses.get(c["status"], 0) + 1
    fastcov = [c for c in cases if c["impl"].startswith("fastcov")]
    fused = [{k: c.get(k) for k in ("impl", "group", "n", "fwd_ms", "fb_ms", "fwd_pct_floor", "fb_pct_floor",
                                    "floor_fb_ms", "speedup_fb", "fb_peak_bytes", "check")}
             for c in fastcov if c["status"] == "ok"]
    summary = f"{len(cases)} cases ({', '.join(f'{n} {k}' for k, n in statuses.items())})" + "".join(
        f"; {f['impl']} {f['group']} N={f['n']}: fwd+bwd {_fmt(f['fb_ms'], '.2f')} ms, "
        f"{_fmt(f['fb_pct_floor'], '.0f')}% of floor, {_fmt(f['speedup_fb'], '.2f')}x naive" for f in fused)
    not_ok = [f"{c['impl']} {c['group']} N={c['n']}: {c['status']}: {c.get('reason') or '-'}"
              for c in fastcov if c["status"] != "ok"]
    if proc.timed_out:
        status, reason = "timeout", f"stopped after {proc.wall_s:.0f} s with {len(cases)} cases: {proc.tail(2)}"
    elif proc.rc != 0 or not cases:
        status, reason = "error", f"bench.kernels exited {proc.rc}: {proc.tail(4)}"
    elif not_ok:
        status, reason = "fail", "; ".join(not_ok[:4])
    else:
        status, reason = "ok", ""
    s.record(part, f"{name}: preset {preset}", status, reason, summary, preset=preset, results_jsonl=str(lines),
             cases=len(cases), statuses=statuses, fastcov=fused, returncode=proc.rc, wall_s=proc.wall_s,
             command=" ".join(["python -m bench.kernels --preset", preset, *extra]))


def compile_predictions(arch: str, path: Path = COMPILE_REPORT) -> dict[tuple[str, str, str], dict]:
    """The compile report's rows for ``arch`` (``sm_90a``) with no switches on: (kernel, dtype, config) -> row."""
    if not path.is_file():
        return {}
    out = {}
    for r in read_jsonl(path):
        sw = r.get("switch") or {}
        if r.get("arch") == arch and not sw.get("HAS_BIAS") and not sw.get("COV") and not sw.get("TOPK"):
            out[(r["kernel"], r["dtype"], r["config"])] = r
    return out


def autotune_rows(cases: list[dict], arch: str, predictions: dict) -> list[dict]:
    """One entry per (shape, kernel) the autotuner picked a config for, beside what the compile report
    predicted for that config on ``arch`` (registers, spills, shared memory, tensor-core path, compile s)."""
    out = []
    for c in cases:
        for pick in c.get("autotune") or []:
            # Triton appends every tensor argument's dtype to the key: the first is the hidden states' (the last,
            # the top-k indices', is int32 whatever the input)
            dtype = next((str(k).removeprefix("torch.") for k in pick["key"] if str(k).startswith("torch.")),
                         c.get("dtype"))
            pred = predictions.get((pick["kernel"], dtype, pick["config"]))
            out.append({"group": c["group"], "n": c["n"], "kernel": pick["kernel"], "key": pick["key"],
                        "config": pick["config"], "dtype": dtype, "in_report": pred is not None,
                        **{k: (pred or {}).get(k) for k in ("registers", "spill_stores", "spill_loads", "smem",
                                                            "tensor_cores", "compile_s")}})
    return out


def record_autotune(s: Suite, part: str) -> None:
    """The configs fastcov-triton's autotuners picked (from the kernel case lines) beside the compile report."""
    lines = kernels_jsonl(s)
    cases = [c for c in (read_jsonl(lines) if lines.is_file() else []) if c.get("impl") == "fastcov-triton"
             and c.get("autotune")]
    if not torch.cuda.is_available():
        s.record(part, "autotune picks", "unavailable", "no autotuning off CUDA (the interpreter runs fixed tiles)")
        return
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{10 * major + minor}" + ("a" if major >= 9 else "")
    rows = autotune_rows(cases, arch, compile_predictions(arch))
    if not rows:
        s.record(part, "autotune picks", "error", "no fastcov-triton case recorded an autotuned config")
        return
    spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    summary = "; ".join(f"{r['kernel'].rsplit('.', 1)[-1]} {r['group']} N={r['n']}: {r['config']} "
                        f"({_fmt(r['registers'], 'd')} regs, {_fmt(r['spill_stores'], 'd')} B spilled predicted)"
                        for r in rows)
    s.record(part, "autotune picks", "fail" if spilled else "ok",
             f"{len(spilled)} picked config(s) predicted to spill" if spilled else "", summary, arch=arch, picks=rows,
             compile_report=str(COMPILE_REPORT))
