"""Compile report: every Triton kernel for sm_80, sm_90a and sm_100a, without a GPU.

    python -m bench.compile                       # fastcov's kernels, the full matrix (make compile-report)
    python -m bench.compile --peers               # plus Cut Cross-Entropy's and Liger's kernels
    python -m bench.compile --kernels _dz_kernel --archs 90 --dtypes bfloat16

Each case (kernel × dtype × compile-time switches × launch config × arch) is compiled by Triton's CUDA
backend from the AST (``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))``,
a fresh cache, so the seconds are a user's first call), then its PTX goes through ``ptxas -v`` from
Triton's own ``backends/nvidia/bin`` (``ptxas-blackwell``, the one that reads Triton 3.9's PTX) with
the flags Triton uses. Recorded per case: registers, spill stores/loads, stack frame, shared memory,
tensor-core path (tcgen05 / wgmma / mma / none) and compile seconds.

The kernels and their signatures come from ``fastcov.kernels.compile_table`` (one table beside the
kernels); the peers' from ``bench/compile_peers.py``. Results: one JSON line per case in
``bench/results/compile/<name>.jsonl`` and a markdown summary next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ARCHS = (80, 90, 100)
REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "compile"


def arch_name(cap: int) -> str:
    return f"sm_{cap}" if cap < 90 else f"sm_{cap}a"


@dataclass
class Case:
    kernel: str
    dtype: str
    switch: dict
    launch: object  # compile_table.Launch
    arch: int
    row: object     # compile_table.KernelRow (or a peer row with the same interface)

    def key(self) -> dict:
        return {"kernel": self.kernel, "dtype": self.dtype, "switch": self.switch, "config": self.launch.label(),
                "num_warps": self.launch.num_warps, "num_stages": self.launch.num_stages,
                "maxnreg": getattr(self.launch, "maxnreg", None),
                "meta": self.launch.meta, "arch": arch_name(self.arch)}


def ptxas_path() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"


def cuda_backend_reason(check_interpret: bool = True) -> str | None:
    """Why AOT compilation cannot run here (in this process, with ``check_interpret``), or None."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason, reported
        return f"triton's CUDA backend not importable: {exc}"
    if check_interpret and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: @triton.jit gives interpreter functions (unset it to compile)"
    if not ptxas_path().is_file():
        return f"no ptxas at {ptxas_path()}"
    return None


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def parse_ptxas(log: str) -> dict:
    """Registers, spill stores/loads and stack frame (bytes per thread) from ``ptxas -v`` output."""
    out = {}
    for key, pattern in _PTXAS.items():
        found = [int(x) for x in pattern.findall(log)]
        out[key] = max(found) if found else None
    return out


def tensor_core_path(ptx: str) -> str:
    if "tcgen05.mma" in ptx:
        return "tcgen05"
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if re.search(r"\bmma\.sync", ptx):
        return "mma"
    return "none"


def run_ptxas(ptx: str, arch: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [str(ptxas_path()), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch_name(arch)}",
               str(src), "-o", str(Path(tmp) / "k.cubin")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed: {proc.stderr.strip()[-400:]}")
        return proc.stderr + proc.stdout


def compile_case(case: Case) -> dict:
    """Compile one case and read its resources; never raises (errors land in the record)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rec = case.key()
    row = case.row
    try:
        src = ASTSource(row.fn, row.signature(case.dtype), row.constexprs(case.dtype, case.switch, case.launch),
                        row.attrs())
        t0 = time.perf_counter()
        compiled = triton.compile(src, target=GPUTarget("cuda", case.arch, 32),
                                  options=case.launch.options())
        rec["compile_s"] = round(time.perf_counter() - t0, 3)
        ptx = compiled.asm["ptx"]
        rec.update(parse_ptxas(run_ptxas(ptx, case.arch)))
        rec["smem"] = int(compiled.metadata.shared)
        rec["tensor_cores"] = tensor_core_path(ptx)
        rec["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - one failing case must not stop the report
        rec.update(status="error", reason=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
    return rec


def _fastcov_rows():
    from fastcov.kernels.compile_table import KERNELS

    return list(KERNELS)


def _jit(obj):
    """The JITFunction under autotune/heuristics wrappers."""
    while not hasattr(obj, "arg_names") or hasattr(obj, "fn") and hasattr(obj.fn, "arg_names"):
        obj = obj.fn
    return obj


def _peer_row(name, fn, types: dict, fixed: dict, ones=(), aligned=(), launches=()):
    """A compile-table row for a peer's kernel: ``types`` maps its runtime arguments to Triton types
    ("{dt}" the input dtype); every other argument is a constexpr from ``fixed`` or the launch."""
    from fastcov.kernels.compile_table import KernelRow

    jit = _jit(fn)
    params = tuple((a, types.get(a, "constexpr")) for a in jit.arg_names)
    return KernelRow(name=name, fn=jit, params=params, dtypes=("bfloat16",), switches=({},),
                     launches=lambda dt, sw, arch: list(launches), fixed=fixed, ones=tuple(ones),
                     aligned=tuple(aligned))


def _cce_launches(best, extra_min_tile=128 * 128):
    """CCE's shipped config (CCE_AUTOTUNE unset) and, from its CCE_AUTOTUNE=1 list, the large tiles."""
    from cut_cross_entropy.tl_autotune import get_autotune_config

    from fastcov.kernels.compile_table import Launch

    out = [Launch(dict(best.kwargs), best.num_warps, best.num_stages)]
    for c in get_autotune_config():
        kw = c.kwargs
        if kw["BLOCK_B"] * kw["BLOCK_V"] >= extra_min_tile and c.num_warps <= 8:
            launch = Launch(dict(kw), c.num_warps, c.num_stages)
            if launch not in out:
                out.append(launch)
    return out


def _baseline_rows(rev: str):
    """The forward and dZ kernels of ``kernels/linear_logprob_entropy.py`` at git revision ``rev``, with
    that revision's autotune configs, under the current table's signatures (before/after comparisons)."""
    import dataclasses
    import importlib.util

    from fastcov.kernels.compile_table import Launch, by_name

    src = subprocess.run(["git", "show", f"{rev}:kernels/linear_logprob_entropy.py"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="fastcov-baseline-")) / f"lle_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"lle_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = []
    for kernel, tuned in (("_forward_kernel", module._forward_tuned), ("_dz_kernel", module._dz_tuned)):
        launches = [Launch(dict(c.kwargs), c.num_warps, c.num_stages) for c in tuned.configs]
        rows.append(dataclasses.replace(by_name(f"linear_logprob_entropy.{kernel}"), fn=getattr(module, kernel),
                                        name=f"{rev}:{kernel}", launches=lambda dt, sw, arch, ls=launches: ls))
    return rows


def _peer_rows():
    """Cut Cross-Entropy's forward (matmul + LSE) and backward, Liger's cross-entropy kernel; those
    not installed are left out (pip install -e '.[bench]')."""
    rows = []
    try:
        rows += _cce_rows()
    except ImportError as exc:
        print(f"cut-cross-entropy not importable ({exc}); left out", file=sys.stderr)
    try:
        rows += _liger_rows()
    except ImportError as exc:
        print(f"liger-kernel not importable ({exc}); left out", file=sys.stderr)
    return rows


def _cce_rows():
    from cut_cross_entropy import cce_backward, cce_lse_forward, tl_autotune

    dt, f32, i32 = "*{dt}", "*fp32", "*i32"
    fwd = _peer_row(
        "cce.cce_lse_forward._cce_lse_forward_kernel", cce_lse_forward._cce_lse_forward_kernel,
        dict(E=dt, C=dt, LSE=f32, Locks=i32, B="i32", V="i32", D="i32", stride_eb="i32", stride_cv="i32",
             num_locks="i32", B_BIN="i32"),
        dict(LA=None, Valids=None, softcap=None, HAS_VALIDS=False, GROUP_B=8, EVEN_D=True, HAS_SOFTCAP=False,
             HAS_LA=False, DOT_PRECISION="tf32"),
        ones=("stride_ed", "stride_cd", "stride_lse_b", "stride_vb"), aligned=("D", "stride_eb", "stride_cv"),
        launches=_cce_launches(tl_autotune._cce_forward_best_config()))
    bwd_launches = _cce_launches(tl_autotune._cce_backward_best_config())
    for launch in bwd_launches:
        launch.meta["MM_BACK_BLOCK_D"] = 2 * launch.meta["BLOCK_D"]
    bwd = _peer_row(
        "cce.cce_backward._cce_backward_kernel", cce_backward._cce_backward_kernel,
        dict(E=dt, C=dt, LSE=f32, dOut=f32, grad_scale="fp32", Targets="*i64", dE=dt, dELocks=i32, dC=dt,
             dCLocks=i32, B="i32", D="i32", V="i32", n_de_locks_0="i32", n_de_locks_1="i32", n_dc_locks_0="i32",
             n_dc_locks_1="i32", stride_eb="i32", stride_cv="i32", filter_eps="fp32", B_BIN="i32"),
        dict(Valids=None, VocabOrdering=None, softcap=None, GROUP_B=8, EVEN_D=True, MM_BACK_EVEN_D=True,
             ITEM_DO=False, HAS_VALIDS=False, HAS_VOCAB_ORDERING=False, FILTER_GRAD=True, HAS_TARGETS=True,
             HAS_SOFTCAP=False, SHIFT=False, REQUIRES_GRAD=True),
        ones=("stride_ed", "stride_cd", "stride_vb"), aligned=("D", "stride_eb", "stride_cv"),
        launches=bwd_launches)
    return [fwd, bwd]


def _liger_rows():
    from liger_kernel.ops import cross_entropy as lce

    from fastcov.kernels.compile_table import Launch

    # its launcher: BLOCK_SIZE = min(32768, next_pow2(V)); 32 warps on Hopper, 8 on Blackwell for bf16
    launches = [Launch({"BLOCK_SIZE": 32768}, 32, 3), Launch({"BLOCK_SIZE": 32768}, 8, 3)]
    return [_peer_row(
        "liger.cross_entropy.liger_cross_entropy_kernel", lce.liger_cross_entropy_kernel,
        dict(X_ptr="*{dt}", X_stride="i32", Y_ptr="*i64", loss_ptr="*fp32", token_accuracy_stride="i32",
             predicted_tokens_stride="i32", n_cols="i32", n_non_ignore="i32", sum_non_ignore_weight="fp32",
             weight_sum="fp32", ignore_index="i32"),
        dict(weight_ptr=None, z_loss_ptr=None, token_accuracy_ptr=None, predicted_tokens_ptr=None, softcap=None,
             lse_square_scale=0.0, label_smoothing=0.0, reduction="none", RETURN_Z_LOSS=False,
             RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False, HAS_WEIGHT=False, HAS_SOFTCAPPING=False,
             HAS_GRADIENTS=True),
        ones=("Y_stride", "loss_stride"), aligned=("X_stride",), launches=launches)]


def cases(rows, archs=ARCHS, dtypes=None, kernels=None, quick=False):
    """Every (row × dtype × switch × launch × arch), or with ``quick`` one launch per (row, dtype)
    and the switches all on (the heaviest variant)."""
    out = []
    for row in rows:
        if kernels and not any(k in row.name for k in kernels):
            continue
        for dtype in row.dtypes:
            if dtypes and dtype not in dtypes:
                continue
            switches = [row.switches[-1]] if quick else row.switches
            for switch in switches:
                for arch in archs:
                    launches = row.launches(dtype, switch, arch)
                    for launch in launches[:1] if quick else launches:
                        out.append(Case(row.name, dtype, switch, launch, arch, row))
    return out


def _switch_label(switch: dict) -> str:
    on = [k if v is True else f"{k}={v}" for k, v in switch.items() if v and k != "TOPK_PAD"]
    return ",".join(on) or "-"


def render_md(records: list[dict], title: str, command: str) -> str:
    """The summary: per kernel × dtype × switches × arch, spill-free configs, worst spills, compile seconds;
    then one line per case."""
    lines = [f"# {title}", "", f"`{command}`; registers/spills/stack are bytes per thread from `ptxas -v` "
             "(ptxas-blackwell of Triton's backend), smem from Triton's metadata, seconds = `triton.compile` "
             "with a fresh cache (what the autotuner pays per config on a first call).", ""]
    lines += _summary_table(records) + [""] + _compile_cost_table(records) + [""] + _case_table(records)
    return "\n".join(lines) + "\n"


def _group(records, key):
    groups: dict = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return groups


def _summary_table(records):
    lines = ["## Spills per kernel, dtype, switches and arch", "",
             "| kernel | dtype | switches | arch | configs | spill-free | max spill stores B | max regs "
             "| tensor cores | compile s (sum) |", "|---|---|---|---|---:|---:|---:|---:|---|---:|"]
    groups = _group(records, lambda r: (r["kernel"], r["dtype"], _switch_label(r["switch"]), r["arch"]))
    for (kernel, dtype, sw, arch), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        clean = sum(1 for r in ok if not r["spill_stores"] and not r["spill_loads"])
        worst = max((r["spill_stores"] or 0 for r in ok), default=None)
        regs = max((r["registers"] or 0 for r in ok), default=None)
        paths = "/".join(sorted({r["tensor_cores"] for r in ok})) or "—"
        secs = sum(r.get("compile_s", 0) for r in ok)
        errors = len(rs) - len(ok)
        lines.append(f"| {kernel} | {dtype} | {sw} | {arch} | {len(rs)}{f' ({errors} errors)' if errors else ''} "
                     f"| {clean} | {worst} | {regs} | {paths} | {secs:.1f} |")
    return lines


def _compile_cost_table(records):
    lines = ["## Compile cost of a first call (the autotune space, per kernel, dtype, switches)", "",
             "| kernel | arch | cases | mean s per config | max s | autotune space s (mean over dtype×switches) |",
             "|---|---|---:|---:|---:|---:|"]
    for (kernel, arch), rs in _group([r for r in records if r["status"] == "ok"],
                                     lambda r: (r["kernel"], r["arch"])).items():
        secs = [r["compile_s"] for r in rs]
        spaces = _group(rs, lambda r: (r["dtype"], _switch_label(r["switch"])))
        per_space = sum(sum(x["compile_s"] for x in v) for v in spaces.values()) / max(1, len(spaces))
        lines.append(f"| {kernel} | {arch} | {len(rs)} | {sum(secs) / len(secs):.2f} | {max(secs):.2f} "
                     f"| {per_space:.1f} |")
    return lines


def _case_table(records):
    lines = ["## Every case", "", "| kernel | dtype | switches | config | arch | regs | spill st/ld B | stack B "
             "| smem B | tensor cores | s |", "|---|---|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['kernel']} | {r['dtype']} | {_switch_label(r['switch'])} | {r['config']} "
                         f"| {r['arch']} | error: {r['reason'][:120]} | | | | | |")
            continue
        lines.append(f"| {r['kernel']} | {r['dtype']} | {_switch_label(r['switch'])} | {r['config']} | {r['arch']} "
                     f"| {r['registers']} | {r['spill_stores']}/{r['spill_loads']} | {r['stack']} | {r['smem']} "
                     f"| {r['tensor_cores']} | {r['compile_s']:.2f} |")
    return lines


def _worker(args):
    rows = {r.name: r for r in (_fastcov_rows() + (_peer_rows() if args[1] else []))}
    case = args[0]
    case.row = rows[case.kernel]
    return compile_case(case)


def run(case_list, jobs: int = 1, log=None):
    """Compile every case (``jobs`` processes), in order; yields records as they finish."""
    if jobs <= 1:
        for case in case_list:
            rec = compile_case(case)
            if log:
                log(rec)
            yield rec
        return
    import multiprocessing as mp

    peers = any(not c.kernel.startswith(("linear_logprob_entropy", "covariance")) for c in case_list)
    payload = []
    for c in case_list:
        payload.append((Case(c.kernel, c.dtype, c.switch, c.launch, c.arch, None), peers))
    with mp.get_context("spawn").Pool(jobs) as pool:
        for rec in pool.imap(_worker, payload):
            if log:
                log(rec)
            yield rec


def _log(rec: dict) -> None:
    if rec["status"] == "ok":
        print(f"{rec['kernel']:45s} {rec['dtype']:9s} {_switch_label(rec['switch']):24s} {rec['config']:22s} "
              f"{rec['arch']:7s} regs {rec['registers']:3d} spill {rec['spill_stores']}/{rec['spill_loads']} "
              f"{rec['tensor_cores']:7s} {rec['compile_s']:.2f}s", file=sys.stderr, flush=True)
    else:
        print(f"{rec['kernel']} {rec['dtype']} {rec['config']} {rec['arch']}: {rec['reason']}", file=sys.stderr,
              flush=True)


def _ident(rec: dict) -> tuple:
    return (rec["kernel"], rec["dtype"], json.dumps(rec["switch"], sort_keys=True), rec["config"], rec["arch"],
            rec.get("maxnreg"))


def _reusable(paths) -> dict:
    """Records of earlier runs by case (ok ones only)."""
    known = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            if rec["status"] == "ok":
                known[_ident(rec)] = rec
    return known


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", type=int, nargs="+", default=list(ARCHS), help="compute capabilities (80 90 100)")
    p.add_argument("--kernels", nargs="+", help="substrings of kernel names to keep")
    p.add_argument("--dtypes", nargs="+", help="torch dtype names to keep")
    p.add_argument("--peers", action="store_true", help="also Cut Cross-Entropy's and Liger's Triton kernels")
    p.add_argument("--no-fastcov", action="store_true", help="only the peers")
    p.add_argument("--baseline", metavar="REV", help="instead: the forward/dZ kernels and configs at a git revision")
    p.add_argument("--switches", choices=["all", "none-and-all"], default="all",
                   help="none-and-all: only every switch off and every switch on (bias excepted)")
    p.add_argument("--reuse", nargs="+", metavar="JSONL", default=[],
                   help="take a case's record from these files when they hold it (the last file wins) and compile "
                        "only the rest: valid only while the kernels' sources are unchanged since those runs")
    p.add_argument("--quick", action="store_true", help="one config per kernel and dtype, switches all on")
    p.add_argument("--jobs", type=int, default=1, help="compile processes (the machine is shared: default 1)")
    p.add_argument("--name", default="fastcov", help="results file stem under --out")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    reason = cuda_backend_reason()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastcov-compile-")  # a first call, every time
    rows = ([] if args.no_fastcov else _fastcov_rows()) + (_peer_rows() if args.peers else [])
    if args.baseline:
        rows = _baseline_rows(args.baseline)
    case_list = cases(rows, args.archs, args.dtypes, args.kernels, args.quick)
    if args.switches == "none-and-all":
        case_list = [c for c in case_list if not c.switch.get("HAS_BIAS")
                     and len({bool(v) for k, v in c.switch.items() if k not in ("HAS_BIAS", "TOPK_PAD")}) <= 1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / f"{args.name}.jsonl"
    command = "python -m bench.compile " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.perf_counter()
    records = []
    known = _reusable(args.reuse)
    fresh = iter(run([c for c in case_list if _ident(c.key()) not in known], 1 if args.baseline else args.jobs,
                     _log))
    with jpath.open("w") as f:
        for case in case_list:
            rec = known.get(_ident(case.key())) or next(fresh)
            records.append(rec)
            f.write(json.dumps(rec) + "\n")
            f.flush()
    jpath.with_suffix(".md").write_text(render_md(records, f"Compile report: {args.name}", command.strip()))
    bad = [r for r in records if r["status"] != "ok"]
    print(f"{len(records)} cases in {time.perf_counter() - t0:.0f} s, {len(bad)} errors; wrote {jpath} and .md",
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
