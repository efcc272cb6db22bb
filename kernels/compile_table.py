"""Every Triton kernel in ``kernels/`` with what it takes to compile it ahead of time, in one table.

``python -m bench.compile`` compiles each entry for sm_80, sm_90a and sm_100a without a GPU
(``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))``) and reads registers
and spills from ``ptxas -v``; ``tests/kernels/test_compile.py`` checks that every ``@triton.jit`` function
named ``*_kernel`` in this folder has a row here, so a new kernel cannot be left out of the report.

A row gives the runtime signature with ``{dt}`` standing for the input dtype (pointers are assumed
16-byte aligned and the ``ALIGNED`` integers multiples of 16, as Triton specializes them at launch),
the integer arguments a launch always passes as 1 (Triton turns those into constants too), the
dtypes, the compile-time switch combinations and the launch configurations (for an autotuned kernel,
every config the autotuner may pick for that dtype).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from fastcov.kernels import covariance as _cov
from fastcov.kernels import linear_logprob_entropy as _lle

TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


@dataclass(frozen=True)
class Launch:
    """One launch configuration: the tile constexprs and Triton's num_warps/num_stages."""
    meta: dict
    num_warps: int
    num_stages: int
    maxnreg: int | None = None

    def options(self) -> dict:
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        return opts if self.maxnreg is None else dict(opts, maxnreg=self.maxnreg)

    def label(self) -> str:
        tiles = "x".join(str(v) for v in self.meta.values()) or "-"
        return f"{tiles}/w{self.num_warps}s{self.num_stages}"


@dataclass(frozen=True)
class KernelRow:
    name: str                       # report name, "<module>.<function>"
    fn: object                      # the @triton.jit function
    params: tuple                   # (name, type) in order; "{dt}" the input dtype, "{cdt}" fp32/fp64 statistics
    dtypes: tuple                   # torch dtype names it takes
    switches: tuple                 # dicts of compile-time switch values (one compile each)
    launches: Callable[[str, dict, int], list]  # (dtype, switch, arch) -> [Launch], what the autotuner may pick
    fixed: dict = field(default_factory=dict)   # constexprs that never change
    ones: tuple = ()                # integer arguments always 1 at launch (unit strides)
    aligned: tuple = ()             # integer arguments assumed to be multiples of 16
    dtype_constexprs: Callable[[str], dict] = lambda dt: {}

    def signature(self, dtype: str) -> dict:
        tdt = TRITON_DTYPES[dtype]
        cdt = "fp64" if dtype == "float64" else "fp32"  # the statistics' dtype
        return {name: ("constexpr" if name in self.ones else kind.replace("{dt}", tdt).replace("{cdt}", cdt))
                for name, kind in self.params}

    def constexprs(self, dtype: str, switch: dict, launch: Launch) -> dict:
        out = {name: 1 for name in self.ones}
        out.update(self.fixed, **self.dtype_constexprs(dtype), **switch, **launch.meta)
        return out

    def attrs(self) -> dict:
        """Triton's launch-time specialization: 16-byte aligned pointers, ``aligned`` ints divisible by 16."""
        names = [name for name, _ in self.params]
        return {(names.index(name),): [["tt.divisibility", 16]] for name, kind in self.params
                if kind.startswith("*") or name in self.aligned}


def _space(space_of) -> Callable[[str, dict, int], list]:
    """Launches from a kernel module's config space function (the one its autotuner prunes with)."""
    def launches(dtype: str, switch: dict, arch: int) -> list:
        if "TOPK" in switch:
            space = space_of(dtype, switch["TOPK"], switch["HAS_BIAS"], switch["COV"], arch,
                             softcap=switch.get("SOFTCAP", False))
        else:
            space = space_of(dtype, arch=arch, softcap=switch.get("SOFTCAP", False))
        return [Launch({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_D": bd}, w, st, _lle.MAXNREG)
                for bn, bv, bd, w, st in space]
    return launches


def _switch_grid(**axes) -> tuple:
    keys = list(axes)
    return tuple(dict(zip(keys, values, strict=True)) for values in itertools.product(*(axes[k] for k in keys)))


def _forward_switches() -> tuple:
    """Every switch combination (COV also serves Σπ² alone: the kernel's s2 comes with it)."""
    out = []
    for softcap, bias, cov, topk in itertools.product((False, True), (False, True), (False, True), (0, 5)):
        out.append({"HAS_BIAS": bias, "COV": cov, "TOPK": topk, "TOPK_PAD": 8 if topk else 1, "SOFTCAP": softcap})
    return tuple(out)


# t_ptr: each row's 1/T (fp32 [N]); a scalar temperature arrives as N equal values
_INPUTS = (("h_ptr", "*{dt}"), ("w_ptr", "*{dt}"), ("b_ptr", "*{dt}"), ("y_ptr", "*i64"), ("t_ptr", "*fp32"))
_SHAPE = (("stride_hn", "i32"), ("stride_hd", "i32"), ("stride_wv", "i32"), ("stride_wd", "i32"),
          ("softcap", "fp32"))
_TILES = (("GROUP_N", "constexpr"), ("BLOCK_N", "constexpr"), ("BLOCK_V", "constexpr"), ("BLOCK_D", "constexpr"))


def _precision(dtype: str) -> dict:
    return {"PRECISION": "ieee" if dtype == "float32" else "tf32"}


KERNELS: tuple[KernelRow, ...] = (
    KernelRow(
        name="linear_logprob_entropy._forward_kernel", fn=_lle._forward_kernel,
        params=_INPUTS + (("part_ptr", "*fp32"), ("topv_ptr", "*fp32"), ("topi_ptr", "*i32"),
                          ("N", "i32"), ("V", "i32"), ("D", "i32"), ("SPLITS", "i32"), ("N_BUCKET", "i32"))
        + _SHAPE + (("HAS_BIAS", "constexpr"), ("COV", "constexpr"), ("TOPK", "constexpr"),
                    ("TOPK_PAD", "constexpr"), ("SOFTCAP", "constexpr"), ("PRECISION", "constexpr")) + _TILES,
        dtypes=("bfloat16", "float16", "float32"), switches=_forward_switches(),
        launches=_space(_lle.forward_space), fixed={"GROUP_N": _lle.GROUP_N},
        ones=("stride_hd", "stride_wd"), aligned=("D", "stride_hn", "stride_wv"),
        dtype_constexprs=_precision,
    ),
    KernelRow(
        name="linear_logprob_entropy._dz_kernel", fn=_lle._dz_kernel,
        params=_INPUTS + (("lse_ptr", "*fp32"), ("ent_ptr", "*fp32"), ("g_ptr", "*fp32"), ("e_ptr", "*fp32"),
                          ("dz_ptr", "*{dt}"), ("N", "i32"), ("V", "i32"), ("D", "i32"), ("N_BUCKET", "i32"))
        + _SHAPE + (("HAS_BIAS", "constexpr"), ("SOFTCAP", "constexpr"), ("PRECISION", "constexpr")) + _TILES,
        dtypes=("bfloat16", "float16", "float32"), switches=_switch_grid(SOFTCAP=(False, True), HAS_BIAS=(False, True)),
        launches=_space(_lle.dz_space), fixed={"GROUP_N": _lle.GROUP_N},
        ones=("stride_hd", "stride_wd"), aligned=("D", "stride_hn", "stride_wv"),
        dtype_constexprs=_precision,
    ),
    KernelRow(
        name="covariance._masked_sums_kernel", fn=_cov._masked_sums_kernel,
        params=(("adv_ptr", "*{dt}"), ("logp_ptr", "*{dt}"), ("valid_ptr", "*u8"), ("partials_ptr", "*fp64"),
                ("n_elements", "i32"), ("BLOCK", "constexpr")),
        dtypes=("float32", "bfloat16", "float64"), switches=({},),
        launches=lambda dt, sw, arch: [Launch({"BLOCK": _cov.BLOCK_SIZE}, 4, 3)],
    ),
    KernelRow(
        name="covariance._covariance_keys_kernel", fn=_cov._covariance_keys_kernel,
        params=(("adv_ptr", "*{dt}"), ("logp_ptr", "*{dt}"), ("valid_ptr", "*u8"), ("means_ptr", "*fp64"),
                ("seed_ptr", "*i64"), ("offset_ptr", "*i64"), ("cov_ptr", "*{cdt}"), ("keys_ptr", "*i64"),
                ("n_elements", "i32"), ("BLOCK", "constexpr"), ("USE_FP64", "constexpr"),
                ("WITH_KEYS", "constexpr")),
        dtypes=("float32", "bfloat16", "float64"), switches=_switch_grid(WITH_KEYS=(False, True)),
        launches=lambda dt, sw, arch: [Launch({"BLOCK": _cov.BLOCK_SIZE}, 4, 3)],
        dtype_constexprs=lambda dt: {"USE_FP64": dt == "float64"},
    ),
)


def by_name(name: str) -> KernelRow:
    for row in KERNELS:
        if row.name == name:
            return row
    raise KeyError(name)
