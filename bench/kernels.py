"""Kernel benchmark: fastcov's fused log-prob/entropy vs naive PyTorch and the peers.

    python -m bench.kernels                         # qwen2.5-7b on CUDA, cpu-small without CUDA
    python -m bench.kernels --preset cpu-small      # what `make bench` runs (2 CPU cores, < 2 min)
    python -m bench.kernels --preset gpu            # qwen2.5-7b and qwen2.5-32b, N in {4k, 16k, 64k}
    python -m bench.kernels --preset qwen2.5-7b --n 4096 16384 --impls naive fastcov-triton verl

Per case (implementation x shape) it records the median forward (no_grad: the old/ref log-prob
pass) and forward+backward (upstream sum g*logprob + e*entropy, grads w.r.t. hidden and weight)
times, effective TFLOP/s (2NDV and 8NDV), the share of the measured plain matmul rate in the same
run, the peak memory increment, and ratios against naive in the same run. It also checks each
implementation's log-prob/entropy on a few rows against float64, so a fast-but-wrong kernel shows.
Results: <out>/<device>-<date>.json and .md (runs of other presets on the same day are kept).
See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bench import _measure as M
from bench.peers import DEFAULT_IMPLS, IMPLS, Unavailable

REPO = Path(__file__).resolve().parent.parent
RESULT_MARK = "@@CASE_RESULT "

# A preset is a list of groups; a group is one (D, V) with its token counts.
PRESETS: dict[str, dict] = {
    "cpu-small": {
        # one intra-op thread: on a shared 2-core box a second OpenMP thread makes every parallel
        # region wait for whichever thread the OS descheduled, which hits many-small-op code (the
        # chunked twin) far harder than few-big-op code (naive) and scrambles the ratios.
        "device": "cpu", "dtype": "float32", "warmup": 1, "repeats": 3, "threads": 1,
        "groups": [
            {"name": "main", "d": 256, "v": 16384, "ns": [512, 2048]},
            {"name": "interpreter", "d": 32, "v": 500, "ns": [32], "interpret": True,
             "impls": ["naive", "fastcov-torch", "fastcov-triton"], "warmup": 0, "repeats": 1,
             "note": "fastcov-triton under TRITON_INTERPRET=1 (a numpy emulation): it shows the "
                     "kernels run; its times say nothing about GPU speed"},
        ],
    },
    # the twin against Cut Cross-Entropy's torch_compile path on CPU (issue 31): fp32, the issue's shape
    "cpu-cce": {
        "device": "cpu", "dtype": "float32", "warmup": 1, "repeats": 3, "threads": 2,
        "impls": ["naive", "fastcov-torch", "fastcov-torch-logprob", "cce-torch-compile"],
        "groups": [{"name": "cce-shape", "d": 256, "v": 65536, "ns": [4096]}],
    },
    "qwen2.5-7b": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 3, "repeats": 10,
        "groups": [{"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [4096, 16384, 65536]}],
    },
    "qwen2.5-32b": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 3, "repeats": 10,
        "groups": [{"name": "qwen2.5-32b", "d": 5120, "v": 152064, "ns": [4096, 16384, 65536]}],
    },
    # The GPU run of the kernel issue: both Qwen2.5 heads, bf16, every peer, the cuBLAS floor, one
    # JSON line per case as it finishes; sized to stay under 8 minutes on one H100.
    "h100": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 2, "repeats": 5,
        "impls": ["naive", "naive-compile", "fastcov-triton", "liger", "liger-entropy", "cce", "verl"],
        "groups": [
            {"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [4096, 16384, 65536]},
            {"name": "qwen2.5-32b", "d": 5120, "v": 152064, "ns": [16384, 65536]},
        ],
    },
    # The one-call GPU run (bench/gpu_run.sh): both heads at N 4096 and 16384, fastcov's Triton path beside
    # naive, compiled naive, Liger, CCE and verl; 4 shapes x 2 grad modes = 8 compiled graphs.
    "gpu-run": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 2, "repeats": 5,
        "impls": ["fastcov-triton", "naive", "naive-compile", "liger", "cce", "verl"],
        "groups": [
            {"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [4096, 16384]},
            {"name": "qwen2.5-32b", "d": 5120, "v": 152064, "ns": [4096, 16384]},
        ],
    },
    # what gpu_run.sh adds only when time is left: N 65536 (naive OOMs there on 80 GB; recorded as OOM)
    "gpu-run-large": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 1, "repeats": 3,
        "impls": ["fastcov-triton", "naive", "liger", "cce", "verl"],
        "groups": [
            {"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [65536]},
            {"name": "qwen2.5-32b", "d": 5120, "v": 152064, "ns": [65536]},
        ],
    },
    # gpu_run.sh --rehearse on CPU: the run's two head groups at toy sizes, fastcov's Triton path under the
    # interpreter (the rehearsal exports TRITON_INTERPRET=1), the peers recorded as unavailable without CUDA
    "rehearse": {
        "device": "cpu", "dtype": "float32", "warmup": 0, "repeats": 1, "threads": 1,
        "impls": ["fastcov-triton", "naive", "liger", "cce", "verl"],
        "groups": [
            {"name": "tiny-7b", "d": 32, "v": 500, "ns": [32]},
            {"name": "tiny-32b", "d": 48, "v": 500, "ns": [32]},
        ],
    },
    # a seconds-long run for the smoke test
    "smoke": {
        "device": "auto", "dtype": "float32", "warmup": 1, "repeats": 2,
        "groups": [{"name": "smoke", "d": 64, "v": 1000, "ns": [128]}],
    },
}
PRESET_ALIASES = {"gpu": ["qwen2.5-7b", "qwen2.5-32b"]}
MATMUL_V_CHUNK = 16384
# the cuBLAS floor walks the tokens in chunks whose [chunk, V] logits take at most this many bytes
FLOOR_CHUNK_BYTES = 1 << 30
CHECK_ROWS = 32
# Every benchmark row has a valid label: ignore_index handling is tested in tests/, not timed here.


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def _short(exc: BaseException, limit: int = 300) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
    text = " ".join(line.strip() for line in msg if line.strip())
    return text if len(text) <= limit else text[:limit - 3] + "..."


_BASE_KEYS = ("group", "n", "d", "v", "dtype")


def _base_result(spec: dict, name: str) -> dict:
    res = {"impl": name, **{k: spec[k] for k in _BASE_KEYS}}
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
            if _is_oom(exc):
                self.failed[name][kind] = f"OOM in {what}"
            elif isinstance(exc, ImportError):  # a lazily imported optional backend is missing
                self.failed[name][kind] = "unavailable: " + _short(exc)
            else:
                self.failed[name][kind] = f"error in {what}: " + _short(exc)
                self.results[name].setdefault("traceback", traceback.format_exc(limit=6))
            del exc
            M.free_memory(self.device)
            return None


def _load_impls(spec: dict, device: torch.device) -> tuple[dict, dict]:
    """(callables of the implementations that load, result rows of all of them)."""
    results = {name: _base_result(spec, name) for name in spec["impls"]}
    fns = {}
    for name in spec["impls"]:
        try:
            fns[name] = IMPLS[name].load(device)
        except Unavailable as exc:
            results[name].update(status="unavailable", reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot even load must not stop the run
            results[name].update(status="unavailable", reason="load failed: " + _short(exc))
    return fns, results


def _time_floor(inputs, spec: dict, device: torch.device) -> dict:
    """The same-shape cuBLAS chain's fwd and fwd+bwd times (``floor_calls``), or {"error": ...}."""
    n, d, v = spec["n"], spec["d"], spec["v"]
    try:
        chain = floor_calls(inputs[0], inputs[1])
        floor = {"chunk": chain["chunk"]}
        for kind in ("fwd", "fb"):
            t = M.time_fn(chain[kind], device, warmup=max(1, spec["warmup"]), repeats=max(3, spec["repeats"]))
            floor[f"{kind}_ms"] = M.median(t)
            floor[f"{kind}_tflops"] = M.tflops((2.0 if kind == "fwd" else 8.0) * n * d * v, floor[f"{kind}_ms"])
        return floor
    except Exception as exc:  # noqa: BLE001 - the floor is a reference, its failure is reported
        M.free_memory(device)
        return {"error": _short(exc)}


def _time_impls(spec: dict, device: torch.device, inputs, calls: dict, guard: _Guard) -> dict | None:
    """Time fwd and fwd+bwd of every implementation (round-robin when ``spec["interleave"]``) beside the
    plain matmul ``hidden @ weight[:Vc].T`` and the cuBLAS floor; fills the result rows, returns the
    matmul record (with the floor) or None."""
    n, d, v = spec["n"], spec["d"], spec["v"]
    warmup, repeats, names = spec["warmup"], spec["repeats"], list(calls)
    vc = min(v, MATMUL_V_CHUNK)
    mm_a, mm_w = inputs[0].detach(), inputs[1].detach()[:vc]
    mm_times: list[float] = []
    matmul = None

    def mm_call():
        return torch.matmul(mm_a, mm_w.T)

    floor = _time_floor(inputs, spec, device)
    if not spec.get("interleave"):
        try:
            mm_times = M.time_fn(mm_call, device, warmup=max(2, warmup), repeats=max(5, repeats))
        except Exception as exc:  # noqa: BLE001
            matmul = {"error": _short(exc)}
            M.free_memory(device)
    for kind in ("fwd", "fb"):
        label = "forward" if kind == "fwd" else "forward+backward"
        if spec.get("interleave"):
            times = {name: [] for name in names}
            for it in range(warmup + repeats):
                if kind == "fwd" and matmul is None:
                    try:
                        t = M.time_fn(mm_call, device, warmup=0, repeats=1)
                        mm_times += t if it >= warmup else []
                    except Exception as exc:  # noqa: BLE001
                        matmul = {"error": _short(exc)}
                for name in names:
                    t = guard(name, kind, label, lambda: M.time_fn(calls[name][kind], device, warmup=0, repeats=1))
                    if t and it >= warmup:
                        times[name] += t
        else:
            times = {name: guard(name, kind, label, lambda: M.time_fn(
                calls[name][kind], device, warmup=warmup, repeats=repeats)) for name in names}
        if spec.get("verbose"):
            log(f"    {spec['group']} N={n}: {label} timed for {', '.join(names)}")
        for name, t in times.items():
            if t and kind not in guard.failed[name]:
                guard.results[name].update({f"{kind}_times_ms": t, f"{kind}_ms": M.median(t), f"{kind}_min_ms": min(t)})
    if mm_times and matmul is None:
        ms = M.median(mm_times)
        matmul = {"n": n, "d": d, "v_chunk": vc, "dtype": spec["dtype"], "ms": ms, "times_ms": mm_times,
                  "tflops": M.tflops(2.0 * n * d * vc, ms)}
    if matmul is not None:
        matmul["floor"] = floor
    return matmul


def _check_rows(out, inputs, spec: dict) -> dict:
    """The first rows' log-prob/entropy against float64, outside the measurements."""
    hidden, weight, labels = inputs[:3]
    logprob, entropy = out
    rows = min(spec["n"], spec.get("check_rows", CHECK_ROWS))
    ref_lp, ref_ent = _reference_rows(hidden, weight, labels, float(spec["temperature"]), rows)
    check = {"rows": rows, "logprob_max_abs": float((logprob[:rows].double() - ref_lp).abs().max()),
             "logprob_max": float(logprob.max()), "finite": bool(torch.isfinite(logprob).all())}
    if entropy is not None:
        check["entropy_max_abs"] = float((entropy[:rows].double() - ref_ent).abs().max())
        check["finite"] = check["finite"] and bool(torch.isfinite(entropy).all())
    return check


def _measure_memory(spec: dict, device: torch.device, inputs, fns: dict, calls: dict, guard: _Guard) -> None:
    """Peak memory of fwd and fwd+bwd per implementation, and the float64 check of its forward."""
    if spec.get("mode") == "memory":  # warm up at a tiny shape: lazy imports, compilation, library scratch
        tiny = _make_inputs(min(spec["n"], 16), spec["d"], spec["v"], getattr(torch, spec["dtype"]), device,
                            spec["seed"])
        for name, c in _closures(fns, tiny, float(spec["temperature"])).items():
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
        if spec.get("verbose"):
            log(f"    {spec['group']} N={spec['n']}: memory of {name} measured")


def run_shape(spec: dict) -> dict:
    """Measure the implementations ``spec["impls"]`` at one shape in this process. Never raises.
    Returns {"cases": [one result per implementation], "matmul": the plain matmul rate (with the
    cuBLAS floor) or None}.

    spec["mode"]: "time" (timing only), "memory" (peak memory + the float64 check only) or "all".
    spec["interleave"]: time the implementations round-robin, one call each per round, so that a
    shared machine's load drifts into all of them alike (the CPU default); otherwise one
    implementation after the other, ``warmup`` then ``repeats`` calls each (the CUDA default).
    """
    device = torch.device(spec["device"])
    mode = spec.get("mode", "all")
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    fns, results = _load_impls(spec, device)
    if not fns:
        return {"cases": list(results.values()), "matmul": None}
    guard = _Guard(fns, results, device)
    inputs = _make_inputs(spec["n"], spec["d"], spec["v"], getattr(torch, spec["dtype"]), device, spec["seed"])
    calls = _closures(fns, inputs, float(spec["temperature"]))
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
        results["fastcov-triton"]["autotune"] = shape_autotune_picks(spec["n"], spec["d"], spec["v"])
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


def _case_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    if spec.get("mode") == "memory" and spec["device"] == "cpu":
        M.set_malloc_mode("measure")  # before anything is allocated: see bench/_measure.py
    try:
        out = run_shape(spec)
    except BaseException as exc:  # noqa: BLE001 - report, never exit without a result
        out = {"cases": [{**_base_result(spec, name), "status": "error", "reason": _short(exc),
                          "traceback": traceback.format_exc(limit=6)} for name in spec["impls"]],
               "matmul": None}
    print(RESULT_MARK + json.dumps(out), flush=True)
    return 0


def run_shape_isolated(spec: dict, timeout: float) -> dict:
    """``run_shape`` in a fresh interpreter (clean peak-RSS accounting, TRITON_INTERPRET per group)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if spec.get("interpret"):
        env["TRITON_INTERPRET"] = "1"
    if spec.get("threads"):  # numpy (the Triton interpreter) and OpenMP as well as torch
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(spec["threads"])
    cmd = [sys.executable, "-m", "bench.kernels", "--_case", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cases": [{**_base_result(spec, name), "status": "error", "reason": f"{spec['mode']} process "
                           f"timed out after {timeout:.0f} s"} for name in spec["impls"]], "matmul": None}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    status = "OOM" if proc.returncode in (-9, 137) else "error"
    reason = f"{spec['mode']} process exited {proc.returncode}: {tail}"[:400]
    return {"cases": [{**_base_result(spec, name), "status": status, "reason": reason} for name in spec["impls"]],
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


def _resolve_presets(name: str) -> list[str]:
    return PRESET_ALIASES.get(name, [name])


def _plan_groups(preset: dict, args, device: torch.device, dtype_name: str) -> tuple[list[dict], list[tuple]]:
    """The preset's groups as run (command-line overrides applied) and one (group, n, d, v, impls, warmup,
    repeats, interpreted) per shape."""
    groups_out, plan = [], []
    for grp in preset["groups"]:
        interp = bool(grp.get("interpret"))
        d = grp["d"] if interp or args.d is None else args.d
        v = grp["v"] if interp or args.v is None else args.v
        ns = grp["ns"] if interp or not args.n else args.n
        impls = [i for i in (args.impls or preset.get("impls") or DEFAULT_IMPLS)
                 if grp.get("impls") is None or i in grp["impls"]]
        if interp and (device.type == "cuda" or "fastcov-triton" not in impls):
            continue  # the interpreter group exists for CPU-only machines, for the Triton row
        warmup = grp.get("warmup", args.warmup if args.warmup is not None else preset["warmup"])
        repeats = grp.get("repeats", args.repeats if args.repeats is not None else preset["repeats"])
        groups_out.append({"name": grp["name"], "d": d, "v": v, "ns": ns, "impls": impls, "dtype": dtype_name,
                           "warmup": warmup, "repeats": repeats, "interpret": interp, "note": grp.get("note", "")})
        plan += [(grp["name"], n, d, v, impls, warmup, repeats, interp) for n in ns]
    return groups_out, plan


def _run_one_shape(spec: dict, impls: list[str], device: torch.device, isolate: bool, timeout: float):
    """(result row per implementation, matmul record or None) of one shape: unavailable rows from the
    probes; on CPU timing in one subprocess and memory in a fresh one per case, else all in-process."""
    rows: dict[str, dict] = {}
    runnable, mm = [], None
    for impl in impls:
        reason = _probe(impl, device, spec["interpret"] and isolate)
        if reason:
            rows[impl] = {**_base_result(spec, impl), "status": "unavailable", "reason": reason}
        else:
            runnable.append(impl)
    where = f"{spec['group']} N={spec['n']}"
    if runnable and isolate:
        log(f"... {where}: timing {', '.join(runnable)} (interleaved, one process)")
        timed = run_shape_isolated({**spec, "impls": runnable, "mode": "time"}, timeout)
        mm = timed["matmul"]
        for tres in timed["cases"]:
            if tres["status"] == "unavailable":
                rows[tres["impl"]] = tres
                continue
            log(f"... {where}: memory of {tres['impl']} (fresh process)")
            mres = run_shape_isolated({**spec, "impls": [tres["impl"]], "mode": "memory"}, timeout)["cases"][0]
            rows[tres["impl"]] = _merge(tres, mres)
    elif runnable:
        log(f"... {where}: {', '.join(runnable)} (one process, one after the other)")
        out = run_shape({**spec, "impls": runnable, "mode": "all", "verbose": True})
        mm = out["matmul"]
        rows.update({res["impl"]: res for res in out["cases"]})
    return rows, mm


def _log_matmul(spec: dict, mm: dict) -> None:
    where = f"{spec['group']} N={spec['n']}"
    if mm.get("tflops"):
        log(f"[matmul] {where} [{spec['n']},{spec['d']}]@[{spec['d']},{mm['v_chunk']}] {spec['dtype']}: "
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
    groups_out, plan = _plan_groups(preset, args, device, dtype_name)
    interpreted = {g["name"] for g in groups_out if g["interpret"]}
    total, k = sum(len(p[4]) for p in plan), 0
    for gname, n, d, v, impls, warmup, repeats, interp in plan:
        spec = {"group": gname, "n": n, "d": d, "v": v, "dtype": dtype_name, "device": str(device),
                "temperature": args.temperature, "warmup": warmup, "repeats": repeats, "seed": args.seed,
                "interpret": interp, "interleave": device.type == "cpu", "threads": threads}
        t0 = time.perf_counter()
        rows, mm = _run_one_shape(spec, impls, device, isolate, args.case_timeout)
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


# =========================================================================== output


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "—" if x is None else format(x, spec) + suffix


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
        for key, m in mm.items():
            lines.append(f"| {m['group']} | {m.get('n', '—')} | {m.get('d', '—')} | {m.get('v_chunk', '—')} | "
                         f"{_fmt(m.get('ms'), '.3f')} | {_fmt(m.get('tflops'), '.3f')} |")
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
                fwd = _fmt(c.get("fwd_ms"), ".2f")
                if c["status"] != "ok":
                    tag = "OOM" if c["status"] == "OOM" else "error"
                    fwd = f"{fwd} ({tag}: {c['reason']})" if c.get("fwd_ms") is not None else f"{tag}: {c['reason']}"
                lines.append(
                    f"| {c['n']} | {c['impl']} | {fwd} | {_fmt(c.get('fb_ms'), '.2f')} "
                    f"| {_fmt(c.get('fb_tflops'), '.3f')} "
                    f"| {_fmt(c.get('fwd_pct_matmul'), '.0f', '%')} / {_fmt(c.get('fb_pct_matmul'), '.0f', '%')} "
                    f"| {M.fmt_bytes(c.get('fwd_peak_bytes'))} | {M.fmt_bytes(c.get('fb_peak_bytes'))} "
                    f"| {_fmt(c.get('speedup_fwd'), '.2f', '×')} / {_fmt(c.get('speedup_fb'), '.2f', '×')} "
                    f"| {_fmt(c.get('mem_ratio_fwd'), '.3f')} / {_fmt(c.get('mem_ratio_fb'), '.3f')} "
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
                f"| {r['n']} | {r['impl']} | {_fmt(r.get('fwd_ms'), '.2f')} | {_fmt(r.get('fwd_tflops'), '.3g')} "
                f"| {_fmt(r.get('fwd_pct_floor'), '.0f', '%')} | {_fmt(r.get('fb_ms'), '.2f')} "
                f"| {_fmt(r.get('fb_tflops'), '.3g')} | {_fmt(r.get('fb_pct_floor'), '.0f', '%')} "
                f"| {M.fmt_bytes(r.get('fb_peak_bytes'))} | {_fmt(r.get('speedup_fb'), '.2f', '×')} "
                f"| {_check_cell(r)} |")
        floors = {r["n"]: r for r in rs if r.get("floor_fb_ms")}
        if floors:
            lines += ["", "cuBLAS floor: " + "; ".join(
                f"N {n}: fwd {r['floor_fwd_ms']:.2f} ms, fwd+bwd {r['floor_fb_ms']:.2f} ms "
                f"({r['floor_fb_tflops']:.3g} TFLOP/s)" for n, r in sorted(floors.items()))]
        lines.append("")
    return "\n".join(lines)


# =========================================================================== CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(PRESET_ALIASES),
                   help="default: qwen2.5-7b with CUDA, cpu-small without")
    p.add_argument("--n", type=int, nargs="+", help="token counts, replacing the preset's")
    p.add_argument("--d", type=int, help="hidden size, replacing the preset's")
    p.add_argument("--v", type=int, help="vocabulary size, replacing the preset's")
    p.add_argument("--impls", nargs="+", metavar="IMPL",
                   help=f"subset of {', '.join(IMPLS)} (default: {' '.join(DEFAULT_IMPLS)})")
    p.add_argument("--repeats", type=int, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, help="untimed iterations before timing")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="replacing the preset's")
    p.add_argument("--threads", type=int, help="torch intra-op threads (0: torch's default; "
                   "cpu-small uses 1, see PRESETS)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--isolate", choices=["auto", "always", "never"], default="auto",
                   help="auto: on CPU, timing in one subprocess per shape and memory in a fresh "
                        "subprocess per case (peak RSS needs a fresh process); on CUDA, all in this process")
    p.add_argument("--case-timeout", type=float, default=600.0, help="seconds, per isolated case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="results folder (default bench/results)")
    p.add_argument("--render", metavar="JSONL", help="only write the markdown of a results .jsonl (next to it)")
    p.add_argument("--jsonl", metavar="PATH", help="append the per-case JSON lines here (default "
                   "<out>/<device>/kernels-<date>.jsonl; gpu_run.sh puts them straight into $OUT)")
    p.add_argument("--_case", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._case:
        return _case_main(args._case)
    if args.render:
        src = Path(args.render)
        if not src.is_file():
            log(f"error: --render {src}: no such file")
            return 2
        dst = src.with_suffix(".md")
        dst.write_text(render_jsonl_md(read_jsonl(src)))
        log(f"wrote {dst}")
        return 0
    if args.impls:
        args.impls = list(dict.fromkeys(i for a in args.impls for i in a.split(",") if i))
        unknown = [i for i in args.impls if i not in IMPLS]
        if unknown:
            log(f"error: unknown --impls {unknown}; choose from {', '.join(IMPLS)}")
            return 2
    has_cuda = torch.cuda.is_available()
    preset = args.preset or ("qwen2.5-7b" if has_cuda else "cpu-small")
    names = _resolve_presets(preset)
    wanted = {PRESETS[n]["device"] for n in names}
    if args.device != "auto":
        dev = args.device
    elif wanted == {"cpu"}:
        dev = "cpu"
    else:
        dev = "cuda" if has_cuda else "cpu"
    if dev == "cuda" and not has_cuda:
        log("error: CUDA requested but torch.cuda.is_available() is False")
        return 2
    if "cuda" in wanted and dev != "cuda" and args.device == "auto":
        log(f"error: preset {preset} is for CUDA (bf16, Qwen2.5 shapes); this machine has no CUDA device. "
            "Use --preset cpu-small, or --device cpu to force it.")
        return 2
    device = torch.device(dev)
    env = M.env_info(device)
    date = _dt.date.today().isoformat()
    cmd = "python -m bench.kernels " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    log(f"fastcov bench: {env['device_name']}; torch {env['torch']}, triton {env['triton']}; presets {names}")
    out_dir = Path(args.out)
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    lines_path = Path(args.jsonl).absolute() if args.jsonl else jsonl_path(out_dir, env, date)
    for name in names:
        started = _dt.datetime.now().isoformat(timespec="seconds")
        t0 = time.perf_counter()
        matmul_seen: dict = {}

        def on_case(row, name=name, matmul_seen=matmul_seen):
            M.append_jsonl(lines_path, case_line(row, name, matmul_seen, env, cmd.strip(), date))

        run = run_preset(name, args, device, on_case=on_case, matmul_out=matmul_seen)
        run.update(command=cmd.strip(), started=started, wall_s=time.perf_counter() - t0, env=env)
        jpath, mpath = write_results(run, out_dir, env, date)
        lines_path.with_suffix(".md").write_text(render_jsonl_md(read_jsonl(lines_path)))
        log(f"{name}: {run['wall_s']:.1f} s; wrote {jpath}, {mpath} and {lines_path} (+ .md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
