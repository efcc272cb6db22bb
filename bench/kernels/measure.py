"""Measuring one preset: its shapes in turn (each in a fresh process or in this one), the matmul rate, and the
derived figures (TFLOP/s, % of matmul and floor, ratios against naive). One case is case.py's."""

from __future__ import annotations

import os
import time

import torch

from bench import _measure as M
from bench._common import log
from bench.kernels.case import _base_result, _merge, run_shape, run_shape_isolated
from bench.kernels.presets import PRESETS, CaseSpec, plan_groups
from bench.peers import IMPLS

# =========================================================================== a run


def _flops(n: int, d: int, v: int) -> tuple[float, float]:
    return 2.0 * n * d * v, 8.0 * n * d * v


def _derive(cases: list[dict], matmul: dict, interpreted: set[str] = frozenset()) -> None:
    """Add TFLOP/s, % of matmul rate and ratios vs naive (same group, same N) to each case.
    Speed figures of Triton under the CPU interpreter (groups in ``interpreted``) stay empty."""
    naive = {(c["group"], c["n"]): c for c in cases if c["impl"] == "naive"}
    for c in cases:
        if c["group"] in interpreted and c["impl"] == "fastcov-triton":
            c.update(fwd_tflops=None, fb_tflops=None, fwd_pct_matmul=None, fb_pct_matmul=None,
                     fwd_pct_floor=None, fb_pct_floor=None, speedup_fwd=None, speedup_fb=None)
            ref = naive.get((c["group"], c["n"]))
            for k in ("fwd", "fb"):
                m, mr = c.get(f"{k}_peak_bytes"), ref.get(f"{k}_peak_bytes") if ref else None
                c[f"mem_ratio_{k}"] = m / mr if m is not None and mr else None
            continue
        f_fwd, f_fb = _flops(c["n"], c["d"], c["v"])
        c["fwd_tflops"] = M.tflops(f_fwd, c.get("fwd_ms"))
        c["fb_tflops"] = M.tflops(f_fb, c.get("fb_ms"))
        mm = matmul.get(f'{c["group"]}/{c["n"]}', {}).get("tflops")
        for k in ("fwd", "fb"):
            tf = c[f"{k}_tflops"]
            c[f"{k}_pct_matmul"] = 100.0 * tf / mm if tf and mm else None
        floor = matmul.get(f'{c["group"]}/{c["n"]}', {}).get("floor") or {}
        for k in ("fwd", "fb"):
            t, tf = c.get(f"{k}_ms"), floor.get(f"{k}_ms")
            c[f"{k}_pct_floor"] = 100.0 * tf / t if t and tf else None
        ref = naive.get((c["group"], c["n"]))
        for k in ("fwd", "fb"):
            t, tr = c.get(f"{k}_ms"), ref.get(f"{k}_ms") if ref else None
            c[f"speedup_{k}"] = tr / t if t and tr else None
            m, mr = c.get(f"{k}_peak_bytes"), ref.get(f"{k}_peak_bytes") if ref else None
            c[f"mem_ratio_{k}"] = m / mr if m is not None and mr else None


def _probe(impl: str, device: torch.device, interpret: bool) -> str | None:
    """The parent's cheap availability check; ``interpret``: the case process will run with TRITON_INTERPRET=1."""
    old = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        return IMPLS[impl].probe(device)
    finally:
        if interpret:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old


def _run_one_shape(spec: CaseSpec, device: torch.device, isolate: bool, timeout: float):
    """(result row per implementation, matmul record or None) of one shape: unavailable rows from the
    probes; on CPU timing in one subprocess and memory in a fresh one per case, else all in-process."""
    rows: dict[str, dict] = {}
    runnable, mm = [], None
    for impl in spec.impls:
        reason = _probe(impl, device, spec.interpret and isolate)
        if reason:
            rows[impl] = {**_base_result(spec, impl), "status": "unavailable", "reason": reason}
        else:
            runnable.append(impl)
    where = spec.where
    if runnable and isolate:
        log(f"... {where}: timing {', '.join(runnable)} (interleaved, one process)")
        timed = run_shape_isolated(spec.with_(impls=runnable, mode="time"), timeout)
        mm = timed["matmul"]
        for tres in timed["cases"]:
            if tres["status"] == "unavailable":
                rows[tres["impl"]] = tres
                continue
            log(f"... {where}: memory of {tres['impl']} (fresh process)")
            mres = run_shape_isolated(spec.with_(impls=[tres["impl"]], mode="memory"), timeout)["cases"][0]
            rows[tres["impl"]] = _merge(tres, mres)
    elif runnable:
        log(f"... {where}: {', '.join(runnable)} (one process, one after the other)")
        out = run_shape(spec.with_(impls=runnable, mode="all", verbose=True))
        mm = out["matmul"]
        rows.update({res["impl"]: res for res in out["cases"]})
    return rows, mm


def _log_matmul(spec: CaseSpec, mm: dict) -> None:
    where = spec.where
    if mm.get("tflops"):
        log(f"[matmul] {where} [{spec.n},{spec.d}]@[{spec.d},{mm['v_chunk']}] {spec.dtype}: "
            f"{mm['ms']:.3f} ms, {mm['tflops']:.3f} TFLOP/s")
    fl = mm.get("floor") or {}
    if fl.get("fb_ms"):
        log(f"[floor] {where}: cuBLAS chain fwd {fl['fwd_ms']:.3f} ms, fwd+bwd {fl['fb_ms']:.3f} ms "
            f"({fl['fb_tflops']:.3f} TFLOP/s)")


def run_preset(preset_name: str, args, device: torch.device, on_case=None, matmul_out=None) -> dict:
    """Run every shape of a preset; ``on_case(row)`` is called with each finished, derived row
    (``matmul_out``, when given, is the dict the per-shape matmul/floor results are filled into)."""
    preset = PRESETS[preset_name]
    dtype_name = args.dtype or preset["dtype"]
    isolate = args.isolate == "always" or (args.isolate == "auto" and device.type == "cpu")
    threads = args.threads if args.threads is not None else preset.get("threads", 1 if device.type == "cpu" else 0)
    default_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)  # for what runs in this process
    matmul, cases = ({} if matmul_out is None else matmul_out), []
    groups_out, plan = plan_groups(preset, args, device, dtype_name)
    interpreted = {g["name"] for g in groups_out if g["interpret"]}
    total, k = sum(len(shape.impls) for shape in plan), 0
    for shape in plan:
        gname, n, d, v, impls = shape.group, shape.n, shape.d, shape.v, shape.impls
        spec = CaseSpec(group=gname, n=n, d=d, v=v, dtype=dtype_name, device=str(device),
                        temperature=args.temperature, warmup=shape.warmup, repeats=shape.repeats, seed=args.seed,
                        impls=tuple(impls), interpret=shape.interpret, interleave=device.type == "cpu",
                        threads=threads)
        t0 = time.perf_counter()
        rows, mm = _run_one_shape(spec, device, isolate, args.case_timeout)
        if mm is not None:
            matmul[f"{gname}/{n}"] = {"group": gname, **mm}
            _log_matmul(spec, mm)
        _derive([rows[impl] for impl in impls], matmul, interpreted)
        for impl in impls:
            k += 1
            cases.append(rows[impl])
            log(f"[{k}/{total}] {gname} N={n} D={d} V={v} {impl:<15} " + _progress(rows[impl]))
            if on_case is not None:
                on_case(rows[impl])
        log(f"    ({time.perf_counter() - t0:.1f} s for {gname} N={n})")
    _derive(cases, matmul, interpreted)
    torch.set_num_threads(default_threads)
    return {"preset": preset_name, "device_kind": device.type, "dtype": dtype_name,
            "temperature": args.temperature, "isolated": isolate, "groups": groups_out,
            "threads": threads or default_threads, "matmul": matmul, "cases": cases}


def _progress(res: dict) -> str:
    if res["status"] == "unavailable":
        return f"unavailable: {res['reason']}"
    parts = []
    if res.get("fwd_ms") is not None:
        parts.append(f"fwd {res['fwd_ms']:.2f} ms")
    if res.get("fb_ms") is not None:
        parts.append(f"fwd+bwd {res['fb_ms']:.2f} ms")
    if res.get("fb_peak_bytes") is not None:
        parts.append(f"peak {M.fmt_bytes(res['fb_peak_bytes'])}")
    text = ", ".join(parts) or "-"
    if res["status"] != "ok":
        text += f"  [{res['status']}: {res['reason']}]"
    return text
