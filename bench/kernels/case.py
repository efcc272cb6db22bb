"""Measuring one case: inputs, the implementations' closures, timing beside the plain matmul and the cuBLAS
floor, peak memory, the float64 check, and a case in a fresh process. Timing and memory primitives are
bench/_measure.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from bench import _measure as M
from bench._common import emit_result, is_oom, log, read_result, short
from bench.kernels.presets import CaseSpec
from bench.peers import IMPLS, Unavailable

REPO = Path(__file__).resolve().parents[2]
RESULT_MARK = "@@CASE_RESULT "
MATMUL_V_CHUNK = 16384
# the cuBLAS floor walks the tokens in chunks whose [chunk, V] logits take at most this many bytes
FLOOR_CHUNK_BYTES = 1 << 30


# =========================================================================== one case


def _make_inputs(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, device=device, dtype=torch.float32)
    # logits ~ N(0, 3^2): a spread like a trained LM head's, peaked enough to exercise the max
    weight = torch.randn(v, d, generator=g, device=device, dtype=torch.float32) * (3.0 / d ** 0.5)
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    up_g = torch.randn(n, generator=g, device=device, dtype=torch.float32)
    up_e = torch.randn(n, generator=g, device=device, dtype=torch.float32)
    hidden = hidden.to(dtype).requires_grad_(True)
    weight = weight.to(dtype).requires_grad_(True)
    return hidden, weight, labels, up_g, up_e


@torch.no_grad()
def _reference_rows(hidden, weight, labels, temperature: float, rows: int, chunk: int = 16384):
    """float64 log-prob and entropy of the first ``rows`` tokens, the vocabulary in chunks."""
    h = hidden[:rows].double()
    z = torch.cat([h @ weight[i:i + chunk].double().T for i in range(0, weight.shape[0], chunk)], dim=1)
    z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, labels[:rows, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def floor_calls(hidden: torch.Tensor, weight: torch.Tensor):
    """The same-shape cuBLAS matmul chain: (fwd, fwd+bwd) closures doing only the GEMMs a fused
    kernel cannot avoid, over token chunks of at most FLOOR_CHUNK_BYTES of logits:
    fwd = H·Wᵀ (2·N·D·V FLOPs); fwd+bwd = H·Wᵀ, again (the recompute), Z·W (dH) and Zᵀ·H into dW
    in place (8·N·D·V FLOPs). Their times are the floor "% of floor" divides by."""
    h, w = hidden.detach(), weight.detach()
    n, v = h.shape[0], w.shape[0]
    chunk = max(1, min(n, FLOOR_CHUNK_BYTES // (v * h.element_size())))
    dw = torch.empty_like(w)

    def fwd():
        for r0 in range(0, n, chunk):
            torch.matmul(h[r0:r0 + chunk], w.T)

    def fb():
        for i, r0 in enumerate(range(0, n, chunk)):
            hc = h[r0:r0 + chunk]
            torch.matmul(hc, w.T)
            z = torch.matmul(hc, w.T)
            torch.matmul(z, w)
            if i == 0:
                torch.mm(z.T, hc, out=dw)
            else:
                dw.addmm_(z.T, hc)

    return {"fwd": fwd, "fb": fb, "chunk": chunk, "dw": dw}


_BASE_KEYS = ("group", "n", "d", "v", "dtype")


def _base_result(spec: CaseSpec, name: str) -> dict:
    res = {"impl": name, **{k: getattr(spec, k) for k in _BASE_KEYS}}
    res.update(status="ok", reason="", entropy=IMPLS[name].entropy, fwd_ms=None, fb_ms=None,
               fwd_min_ms=None, fb_min_ms=None, fwd_times_ms=None, fb_times_ms=None,
               fwd_peak_bytes=None, fb_peak_bytes=None, mem_method=None, check=None)
    return res


def _closures(fns: dict, inputs, temperature: float) -> dict:
    """Per implementation: {"fwd": no-grad call, "fb": call + autograd.grad of Σ g·logprob + e·entropy}."""
    hidden, weight, labels, up_g, up_e = inputs
    out = {}
    for name, fn in fns.items():
        def fwd(fn=fn):
            with torch.no_grad():
                return fn(hidden, weight, labels, temperature)

        def fb(fn=fn):
            logprob, entropy = fn(hidden, weight, labels, temperature)
            loss = (logprob.float() * up_g).sum()
            if entropy is not None:
                loss = loss + (entropy.float() * up_e).sum()
            return torch.autograd.grad(loss, (hidden, weight))

        out[name] = {"fwd": fwd, "fb": fb}
    return out


class _Guard:
    """Runs one implementation's call and records, rather than raises, what goes wrong: after a failure
    of its 'fwd' or 'fb' kind that kind is skipped for the rest of the shape."""

    def __init__(self, names, results: dict, device: torch.device):
        self.failed: dict[str, dict[str, str]] = {name: {} for name in names}
        self.results, self.device = results, device

    def __call__(self, name: str, kind: str, what: str, body):
        if kind in self.failed[name]:
            return None
        try:
            return body()
        except Exception as exc:  # noqa: BLE001
            if is_oom(exc):
                self.failed[name][kind] = f"OOM in {what}"
            elif isinstance(exc, ImportError):  # a lazily imported optional backend is missing
                self.failed[name][kind] = "unavailable: " + short(exc)
            else:
                self.failed[name][kind] = f"error in {what}: " + short(exc)
                self.results[name].setdefault("traceback", traceback.format_exc(limit=6))
            del exc
            M.free_memory(self.device)
            return None


def _load_impls(spec: CaseSpec, device: torch.device) -> tuple[dict, dict]:
    """(callables of the implementations that load, result rows of all of them)."""
    results = {name: _base_result(spec, name) for name in spec.impls}
    fns = {}
    for name in spec.impls:
        try:
            fns[name] = IMPLS[name].load(device)
        except Unavailable as exc:
            results[name].update(status="unavailable", reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot even load must not stop the run
            results[name].update(status="unavailable", reason="load failed: " + short(exc))
    return fns, results


def _time_floor(inputs, spec: CaseSpec, device: torch.device) -> dict:
    """The same-shape cuBLAS chain's fwd and fwd+bwd times (``floor_calls``), or {"error": ...}."""
    n, d, v = spec.n, spec.d, spec.v
    try:
        chain = floor_calls(inputs[0], inputs[1])
        floor = {"chunk": chain["chunk"]}
        for kind in ("fwd", "fb"):
            t = M.time_fn(chain[kind], device, warmup=max(1, spec.warmup), repeats=max(3, spec.repeats))
            floor[f"{kind}_ms"] = M.median(t)
            floor[f"{kind}_tflops"] = M.tflops((2.0 if kind == "fwd" else 8.0) * n * d * v, floor[f"{kind}_ms"])
        return floor
    except Exception as exc:  # noqa: BLE001 - the floor is a reference, its failure is reported
        M.free_memory(device)
        return {"error": short(exc)}


def _time_impls(spec: CaseSpec, device: torch.device, inputs, calls: dict, guard: _Guard) -> dict | None:
    """Time fwd and fwd+bwd of every implementation (round-robin when ``spec.interleave``) beside the
    plain matmul ``hidden @ weight[:Vc].T`` and the cuBLAS floor; fills the result rows, returns the
    matmul record (with the floor) or None."""
    n, d, v = spec.n, spec.d, spec.v
    warmup, repeats, names = spec.warmup, spec.repeats, list(calls)
    vc = min(v, MATMUL_V_CHUNK)
    mm_a, mm_w = inputs[0].detach(), inputs[1].detach()[:vc]
    mm_times: list[float] = []
    matmul = None

    def mm_call():
        return torch.matmul(mm_a, mm_w.T)

    floor = _time_floor(inputs, spec, device)
    if not spec.interleave:
        try:
            mm_times = M.time_fn(mm_call, device, warmup=max(2, warmup), repeats=max(5, repeats))
        except Exception as exc:  # noqa: BLE001
            matmul = {"error": short(exc)}
            M.free_memory(device)
    for kind in ("fwd", "fb"):
        label = "forward" if kind == "fwd" else "forward+backward"
        if spec.interleave:
            times = {name: [] for name in names}
            for it in range(warmup + repeats):
                if kind == "fwd" and matmul is None:
                    try:
                        t = M.time_fn(mm_call, device, warmup=0, repeats=1)
                        mm_times += t if it >= warmup else []
                    except Exception as exc:  # noqa: BLE001
                        matmul = {"error": short(exc)}
                for name in names:
                    t = guard(name, kind, label,
                              lambda fn=calls[name][kind]: M.time_fn(fn, device, warmup=0, repeats=1))
                    if t and it >= warmup:
                        times[name] += t
        else:
            times = {name: guard(name, kind, label, lambda fn=calls[name][kind]: M.time_fn(
                fn, device, warmup=warmup, repeats=repeats)) for name in names}
        if spec.verbose:
            log(f"    {spec.group} N={n}: {label} timed for {', '.join(names)}")
        for name, t in times.items():
            if t and kind not in guard.failed[name]:
                guard.results[name].update({f"{kind}_times_ms": t, f"{kind}_ms": M.median(t), f"{kind}_min_ms": min(t)})
    if mm_times and matmul is None:
        ms = M.median(mm_times)
        matmul = {"n": n, "d": d, "v_chunk": vc, "dtype": spec.dtype, "ms": ms, "times_ms": mm_times,
                  "tflops": M.tflops(2.0 * n * d * vc, ms)}
    if matmul is not None:
        matmul["floor"] = floor
    return matmul


def _check_rows(out, inputs, spec: CaseSpec) -> dict:
    """The first rows' log-prob/entropy against float64, outside the measurements."""
    hidden, weight, labels = inputs[:3]
    logprob, entropy = out
    rows = min(spec.n, spec.check_rows)
    ref_lp, ref_ent = _reference_rows(hidden, weight, labels, float(spec.temperature), rows)
    check = {"rows": rows, "logprob_max_abs": float((logprob[:rows].double() - ref_lp).abs().max()),
             "logprob_max": float(logprob.max()), "finite": bool(torch.isfinite(logprob).all())}
    if entropy is not None:
        check["entropy_max_abs"] = float((entropy[:rows].double() - ref_ent).abs().max())
        check["finite"] = check["finite"] and bool(torch.isfinite(entropy).all())
    return check


def _measure_memory(spec: CaseSpec, device: torch.device, inputs, fns: dict, calls: dict, guard: _Guard) -> None:
    """Peak memory of fwd and fwd+bwd per implementation, and the float64 check of its forward."""
    if spec.mode == "memory":  # warm up at a tiny shape: lazy imports, compilation, library scratch
        tiny = _make_inputs(min(spec.n, 16), spec.d, spec.v, spec.torch_dtype, device, spec.seed)
        for name, c in _closures(fns, tiny, float(spec.temperature)).items():
            guard(name, "fb", "warm-up", c["fb"])
            guard(name, "fwd", "warm-up", c["fwd"])
        del tiny
    for name in fns:
        res = guard.results[name]

        def mem(kind, name=name, res=res):
            with M.PeakMemory(device) as pm:
                out = calls[name][kind]()
                M.sync(device)
            res[f"{kind}_peak_bytes"], res["mem_method"] = pm.peak_bytes, pm.method
            return out if kind == "fwd" else None

        out = guard(name, "fwd", "forward (memory)", lambda: mem("fwd"))
        if out is not None:
            res["check"] = _check_rows(out, inputs, spec)
            del out
        guard(name, "fb", "forward+backward (memory)", lambda: mem("fb"))
        if spec.verbose:
            log(f"    {spec.group} N={spec.n}: memory of {name} measured")


def run_shape(spec: CaseSpec) -> dict:
    """Measure the implementations ``spec.impls`` at one shape in this process (``spec.mode``: what to measure,
    ``spec.interleave``: how to time; see ``CaseSpec``). Never raises. Returns {"cases": [one result per
    implementation], "matmul": the plain matmul rate (with the cuBLAS floor) or None}."""
    device = torch.device(spec.device)
    mode = spec.mode
    if spec.threads:
        torch.set_num_threads(spec.threads)
    fns, results = _load_impls(spec, device)
    if not fns:
        return {"cases": list(results.values()), "matmul": None}
    guard = _Guard(fns, results, device)
    inputs = _make_inputs(spec.n, spec.d, spec.v, spec.torch_dtype, device, spec.seed)
    calls = _closures(fns, inputs, float(spec.temperature))
    for name in fns:  # compilation is not what the benchmark times, whatever the warm-up count
        if IMPLS[name].compiles:
            for kind in ("fwd", "fb"):
                guard(name, kind, "compilation", calls[name][kind])
    matmul = _time_impls(spec, device, inputs, calls, guard) if mode in ("all", "time") else None
    if mode in ("all", "memory"):
        _measure_memory(spec, device, inputs, fns, calls, guard)
    for name, fails in guard.failed.items():
        if fails:
            _set_status(results[name], list(fails.values()), [f"{k}: {r}" for k, r in fails.items()])
    if "fastcov-triton" in fns and device.type == "cuda":
        results["fastcov-triton"]["autotune"] = shape_autotune_picks(spec.n, spec.d, spec.v)
    inputs = calls = fns = None  # release the tensors before the allocator is emptied
    M.free_memory(device)
    return {"cases": list(results.values()), "matmul": matmul}


def shape_autotune_picks(n: int, d: int, v: int) -> list[dict]:
    """The configs fastcov's autotuners picked for this shape in this process (``autotune_picks``, filtered
    to the shape's N bucket, V and D); empty when none ran (the interpreter uses fixed tiles)."""
    try:
        from fastcov.kernels.linear_logprob_entropy import autotune_picks, n_bucket
    except ImportError:
        return []
    want = [str(n_bucket(n)), str(v), str(d)]
    return [p for p in autotune_picks() if p["key"][:3] == want]


def _set_status(res: dict, reasons: list[str], labelled: list[str]) -> None:
    if reasons and all(r.startswith("unavailable") for r in reasons):
        res.update(status="unavailable", reason=reasons[0].removeprefix("unavailable: "))
    elif any(r.startswith("OOM") for r in reasons):
        res.update(status="OOM", reason="; ".join(labelled))
    else:
        res.update(status="error", reason="; ".join(labelled))


def case_main(spec_json: str) -> int:
    """An isolated case process (``python -m bench.kernels --_case JSON``): its result as the marked last line."""
    spec = CaseSpec.from_json(spec_json)
    if spec.mode == "memory" and spec.device == "cpu":
        M.set_malloc_mode("measure")  # before anything is allocated: see bench/_measure.py
    try:
        out = run_shape(spec)
    except BaseException as exc:  # noqa: BLE001 - report, never exit without a result
        out = {"cases": [{**_base_result(spec, name), "status": "error", "reason": short(exc),
                          "traceback": traceback.format_exc(limit=6)} for name in spec.impls],
               "matmul": None}
    emit_result(RESULT_MARK, out)
    return 0


def run_shape_isolated(spec: CaseSpec, timeout: float) -> dict:
    """``run_shape`` in a fresh interpreter (clean peak-RSS accounting, TRITON_INTERPRET per group)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if spec.interpret:
        env["TRITON_INTERPRET"] = "1"
    if spec.threads:  # numpy (the Triton interpreter) and OpenMP as well as torch
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(spec.threads)
    cmd = [sys.executable, "-m", "bench.kernels", "--_case", spec.to_json()]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cases": [{**_base_result(spec, name), "status": "error", "reason": f"{spec.mode} process "
                           f"timed out after {timeout:.0f} s"} for name in spec.impls], "matmul": None}
    result = read_result(proc.stdout, RESULT_MARK)
    if result is not None:
        return result
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    status = "OOM" if proc.returncode in (-9, 137) else "error"
    reason = f"{spec.mode} process exited {proc.returncode}: {tail}"[:400]
    return {"cases": [{**_base_result(spec, name), "status": status, "reason": reason} for name in spec.impls],
            "matmul": None}


def _merge(timed: dict, memory: dict) -> dict:
    """One row from the timing process's and the memory process's results for one implementation."""
    out = dict(timed)
    for k in ("fwd_peak_bytes", "fb_peak_bytes", "mem_method", "check"):
        out[k] = memory.get(k)
    if "traceback" in memory:
        out.setdefault("traceback", memory["traceback"])
    bad = [r for r in (timed, memory) if r["status"] != "ok"]
    if bad:
        statuses = {r["status"] for r in bad}
        status = "unavailable" if statuses == {"unavailable"} else "OOM" if "OOM" in statuses else "error"
        out.update(status=status, reason="; ".join(dict.fromkeys(r["reason"] for r in bad)))
    return out
