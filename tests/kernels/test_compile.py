"""The Triton kernels compiled for Hopper and Blackwell without a GPU (issue 31; bench/compile.py).

The quick subset: every kernel of ``fastcov.kernels.compile_table`` at one config per dtype, its
compile-time switches all on, for sm_90a and sm_100a, must compile with zero spill stores and loads
in ``ptxas -v``. The full matrix is ``make compile-report``. Skipped only when Triton's CUDA backend or
its ptxas is absent.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import compile as C
from fastcov.kernels.compile_table import KERNELS

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"


def _jit_kernels_in_sources() -> set[str]:
    """'<module>.<function>' of every @triton.jit function named *_kernel in kernels/*.py."""
    found = set()
    for path in KERNEL_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    found.add(f"{path.stem}.{node.name}")
    return found


def test_every_triton_kernel_has_a_row_in_the_compile_table():
    in_sources = _jit_kernels_in_sources()
    assert "linear_logprob_entropy._forward_kernel" in in_sources  # the scan itself works
    assert in_sources == {row.name for row in KERNELS}


@pytest.mark.parametrize("row", KERNELS, ids=lambda r: r.name)
def test_table_signature_is_the_kernels_argument_list(row):
    assert [name for name, _ in row.params] == list(row.fn.arg_names)
    for dtype in row.dtypes:
        for switch in row.switches:
            for arch in (80, 90, 100):
                launches = row.launches(dtype, switch, arch)
                assert launches, (dtype, switch, arch)
                if row.name.startswith("linear_logprob_entropy"):
                    assert len(launches) >= 4, (dtype, switch, arch)  # the autotuner keeps a choice


def test_parse_ptxas_reads_the_numbers():
    log = ("ptxas info    : Function properties for k\n"
           "    152 bytes stack frame, 208 bytes spill stores, 184 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 152 bytes cumulative stack size\n")
    assert C.parse_ptxas(log) == {"registers": 255, "spill_stores": 208, "spill_loads": 184, "stack": 152}
    assert C.parse_ptxas("nothing")["registers"] is None
    assert C.tensor_core_path("wgmma.mma_async.sync.aligned") == "wgmma"
    assert C.tensor_core_path("tcgen05.mma.cta_group::1") == "tcgen05"
    assert C.tensor_core_path("mma.sync.aligned.m16n8k16") == "mma"
    assert C.tensor_core_path("fma.rn.f32") == "none"


_REASON = C.cuda_backend_reason(check_interpret=False)  # the compile runs in a process without it
_QUICK = C.cases(KERNELS, archs=(90, 100), quick=True)
REPO = KERNEL_DIR.parent


def _case_id(kernel, dtype, arch) -> str:
    return f"{kernel}-{dtype}-{arch}"


@pytest.fixture(scope="module")
def quick_records(tmp_path_factory):
    """One `python -m bench.compile --quick` run in a fresh process (conftest sets TRITON_INTERPRET=1
    here, under which @triton.jit gives interpreter functions that cannot be compiled) with a fresh
    Triton cache: its records keyed by kernel-dtype-arch."""
    out = tmp_path_factory.mktemp("compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(out / "cache"), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "bench.compile", "--quick", "--archs", "90", "100", "--out", str(out),
                           "--name", "quick"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = (out / "quick.jsonl").read_text().splitlines() if (out / "quick.jsonl").exists() else []
    assert lines, proc.stderr[-2000:]
    return {_case_id(r["kernel"], r["dtype"], r["arch"]): r for r in map(json.loads, lines)}


@pytest.mark.skipif(_REASON is not None, reason=f"no AOT CUDA compile here: {_REASON}")
@pytest.mark.parametrize("case", _QUICK, ids=lambda c: _case_id(c.kernel, c.dtype, C.arch_name(c.arch)))
def test_kernel_compiles_without_spills(case, quick_records):
    rec = quick_records[_case_id(case.kernel, case.dtype, C.arch_name(case.arch))]
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["config"] == case.launch.label() and rec["switch"] == case.switch
    assert rec["registers"] is not None and rec["registers"] <= 255
    assert rec["spill_stores"] == 0 and rec["spill_loads"] == 0, rec
    if case.kernel.startswith("linear_logprob_entropy") and case.dtype != "float32":
        assert rec["tensor_cores"] == {90: "wgmma", 100: "tcgen05"}[case.arch], rec


def test_the_committed_report_covers_every_shipped_config_without_spills():
    """bench/results/compile/fastcov.jsonl (``make compile-report``) has an ok record for every case the table offers
    (kernel × dtype × switches × config × sm_80/sm_90a/sm_100a), each with 0 spill stores and loads: a config space
    or switch changed without regenerating the report, or a shipped config that spills, fails here."""
    path = REPO / "bench" / "results" / "compile" / "fastcov.jsonl"
    records = {C._ident(r): r for r in map(json.loads, path.read_text().splitlines())}
    shipped = C.cases(KERNELS)
    missing = [C._ident(c.key()) for c in shipped if C._ident(c.key()) not in records]
    assert not missing, f"{len(missing)} shipped cases not in the report, e.g. {missing[:3]}"
    spilled = [records[C._ident(c.key())] for c in shipped]
    spilled = [r for r in spilled if r["status"] != "ok" or r["spill_stores"] or r["spill_loads"]]
    assert not spilled, spilled[:3]
