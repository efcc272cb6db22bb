"""The Triton kernels compiled for Hopper and Blackwell without a GPU (issue 31; bench/compile.py).

The quick subset: every kernel of ``fastcov.kernels.compile_table`` at one config per dtype, its
compile-time switches all on, for sm_90a and sm_100a, must compile with zero spill stores and loads
in ``ptxas -v``. The full matrix is ``make compile-report``. Skipped only when Triton's CUDA backend or
its ptxas is absent.
"""

from __future__ import annotations

import ast
import os
import tempfile
from pathlib import Path

import pytest

from bench import compile as C
from fastcov.kernels.compile_table import KERNELS

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"


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
            launches = row.launches(dtype, switch)
            assert launches, (dtype, switch)
            if row.name.startswith("linear_logprob_entropy"):
                assert len(launches) >= 4, (dtype, switch)  # the autotuner keeps a choice


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


_REASON = C.cuda_backend_reason()
_QUICK = C.cases(KERNELS, archs=(90, 100), quick=True)


@pytest.fixture(scope="module")
def fresh_cache():
    old = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp
        yield
    if old is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = old


@pytest.mark.skipif(_REASON is not None, reason=f"no AOT CUDA compile here: {_REASON}")
@pytest.mark.parametrize("case", _QUICK, ids=lambda c: f"{c.kernel}-{c.dtype}-{C.arch_name(c.arch)}")
def test_kernel_compiles_without_spills(case, fresh_cache):
    rec = C.compile_case(case)
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["registers"] is not None and rec["registers"] <= 255
    assert rec["spill_stores"] == 0 and rec["spill_loads"] == 0, rec
    if case.kernel.startswith("linear_logprob_entropy") and case.dtype != "float32":
        assert rec["tensor_cores"] == {90: "wgmma", 100: "tcgen05"}[case.arch], rec
