"""Adapters: every benchmarked implementation behind one calling convention.

    fn = IMPLS[name].load(device)          # raises Unavailable(reason) when it cannot run here
    logprob, entropy = fn(hidden, weight, labels, temperature)   # entropy is None where not offered

``hidden`` [N, D], ``weight`` [V, D], ``labels`` [N] int64 (no ignored rows in the benchmark);
``logprob`` / ``entropy`` are per token and differentiable w.r.t. hidden and weight.

``naive-compile`` is the same loop through ``torch.compile``, the cheapest speed-up a user can try.

``probe(device)`` is the cheap check the parent process makes before spawning a case: it imports
nothing heavy (``importlib.util.find_spec`` only), so an absent or CUDA-only peer costs no
subprocess. ``load`` does the real import inside the case's process; any failure there is
reported as "unavailable: load failed: ..." and the benchmark goes on.

Peers are used through their public entry points only; nothing of theirs is copied here.
  liger          liger_kernel.transformers.functional.liger_fused_linear_cross_entropy(reduction="none")
                 -> per-token NLL; no temperature argument (hidden/T is passed instead), no entropy.
  liger-entropy  liger_kernel.ops.LigerFusedLinearScaledCrossEntropyFunction.apply(..., return_entropy=True)
                 -> (NLL, entropy) with temperature (liger-kernel >= 0.8; on sm90 it dispatches to a
                 CuTe-DSL kernel that needs the ``cutedsl`` extra, elsewhere to a chunked torch path).
  cce            cut_cross_entropy.linear_cross_entropy(e, c, targets, reduction="none") -> NLL, with
                 its default gradient filtering (filter_eps="high"); cce-exact passes filter_eps=None.
  verl           verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(hidden, weight, labels,
                 temperature, "none") -> (logprob, entropy). ``import verl`` pulls in ray and more, so
                 verl/utils/kernel/{kernels,linear_cross_entropy}.py are loaded by file path under a
                 private package name, with a stub ``verl.utils.device`` present only while they load.
  fastcov-{triton,torch}-{sum-p2,temperature,softcap}  the base call with one switch of issue 59 (``SWITCH_ROWS``):
                 Σπ² (the κ kernel variant), a per-token temperature tensor, the soft cap's tanh.
  cce-torch-compile  cut_cross_entropy.linear_cross_entropy(..., impl="torch_compile"): CCE's torch.compile
                 path, the one peer that runs on CPU; fastcov-torch-logprob is the twin asked for the same
                 (log-probs only), so the pair compares like with like.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor | None]]


class Unavailable(Exception):
    """The implementation cannot run in this environment; the message is the reason."""


@dataclass(frozen=True)
class Impl:
    name: str
    description: str
    entropy: bool                      # does it return the entropy as well as the log-prob?
    probe: Callable[[torch.device], str | None]
    load: Callable[[torch.device], Fn]
    needs_cuda: bool = True
    compiles: bool = False             # first call per shape compiles: the harness calls it once untimed


# --------------------------------------------------------------------------- naive reference


def naive(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Materialized fp32 logits, log_softmax, gather, entropy = -sum p log p; autograd backward."""
    logits = (hidden @ weight.T).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logprob = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprob, entropy


def _load_naive(device: torch.device) -> Fn:
    return naive


def _load_naive_compiled(device: torch.device) -> Fn:
    """``naive`` through ``torch.compile`` (inductor fuses the softmax/entropy epilogue; the logits stay)."""
    if not hasattr(torch, "compile"):
        raise Unavailable("this torch has no torch.compile")
    raise_recompile_limit()
    return torch.compile(naive, dynamic=False)


# Every benchmark shape x {no_grad, grad} is its own graph (dynamic=False): the h100 preset alone has 5 shapes,
# 10 graphs, past torch's default recompile limit of 8, after which dynamo runs the function uncompiled
# without a word. The limit is raised above any preset's count, and hitting it is made an error.
RECOMPILE_LIMIT = 64


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let ``naive-compile`` compile every shape of a run, and fail loudly rather than fall back to eager."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the first is torch >= 2.6's name of the second
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(limit, getattr(dynamo_config, name)))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(4 * limit, getattr(dynamo_config, name)))
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True


# --------------------------------------------------------------------------- fastcov


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _probe_fastcov(impl: str) -> Callable[[torch.device], str | None]:
    def probe(device: torch.device) -> str | None:
        if importlib.util.find_spec("fastcov") is None:
            return "fastcov not importable"
        if impl == "triton" and device.type != "cuda" and not _interpreting():
            return "Triton kernels need CUDA (on CPU only under TRITON_INTERPRET=1; see the interpreter group)"
        return None

    return probe


# fastcov's switches as benchmark rows (issue 59), each the base call plus one switch. Chosen so that the rows'
# float64 check against the plain reference still holds: the per-token temperature is a tensor of the scalar T,
# and the soft cap 1e4 runs the cap's tanh on every logit while moving logits of |z| ≤ 20 by < 3e-5.
SWITCH_ROWS = {"sum-p2": {"sum_p2": True}, "temperature": {"temperature": "per_token"}, "softcap": {"softcap": 1e4}}


def _load_fastcov(impl: str, switch: str | None = None) -> Callable[[torch.device], Fn]:
    def load(device: torch.device) -> Fn:
        reason = _probe_fastcov(impl)(device)
        if reason:
            raise Unavailable(reason)
        try:
            from fastcov import linear_logprob_entropy
        except ImportError as exc:
            raise Unavailable(f"fastcov.linear_logprob_entropy not importable: {exc}") from exc
        extra = dict(SWITCH_ROWS[switch]) if switch else {}

        def fn(hidden, weight, labels, temperature):
            kw = dict(extra)
            if kw.pop("temperature", None) == "per_token":
                temperature = torch.full(labels.shape, float(temperature), device=labels.device)
            out = linear_logprob_entropy(hidden, weight, labels, temperature=temperature, entropy=True, impl=impl,
                                         **kw)
            return out.logprob, out.entropy

        return fn

    return load


# --------------------------------------------------------------------------- peers (CUDA only)


def _probe_peer(module: str, pip_name: str) -> Callable[[torch.device], str | None]:
    def probe(device: torch.device) -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"not installed (pip install {pip_name})"
        if device.type != "cuda":
            return "needs CUDA (Triton GPU kernels); this run is on CPU"
        return None

    return probe


def _check_peer(module: str, pip_name: str, device: torch.device) -> None:
    reason = _probe_peer(module, pip_name)(device)
    if reason:
        raise Unavailable(reason)


def _load_liger(device: torch.device) -> Fn:
    _check_peer("liger_kernel", "liger-kernel", device)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def fn(hidden, weight, labels, temperature):
        h = hidden if temperature == 1.0 else hidden / temperature
        nll = liger_fused_linear_cross_entropy(h, weight, labels, reduction="none")
        return -nll, None

    return fn


def _load_liger_entropy(device: torch.device) -> Fn:
    _check_peer("liger_kernel", "liger-kernel", device)
    try:
        from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction as F
    except ImportError as exc:
        raise Unavailable(f"this liger-kernel has no LigerFusedLinearScaledCrossEntropyFunction ({exc})") from exc

    def fn(hidden, weight, labels, temperature):
        # On sm90 this dispatches to a CuTe-DSL kernel imported at the first call; without the
        # liger-kernel[cutedsl] extra that raises ImportError, which the harness reports as unavailable.
        nll, ent = F.apply(hidden, weight, labels, temperature=float(temperature), return_entropy=True)
        return -nll, ent

    return fn


def _load_cce(filter_eps) -> Callable[[torch.device], Fn]:
    def load(device: torch.device) -> Fn:
        _check_peer("cut_cross_entropy", "cut-cross-entropy", device)
        from cut_cross_entropy import linear_cross_entropy

        def fn(hidden, weight, labels, temperature):
            h = hidden if temperature == 1.0 else hidden / temperature
            nll = linear_cross_entropy(h, weight, labels, reduction="none", filter_eps=filter_eps)
            return -nll, None

        return fn

    return load


def _load_cce_torch_compile(device: torch.device) -> Fn:
    """Cut Cross-Entropy's ``impl="torch_compile"``: its torch.compile'd path, which runs on CPU too."""
    if importlib.util.find_spec("cut_cross_entropy") is None:
        raise Unavailable("not installed (pip install cut-cross-entropy)")
    from cut_cross_entropy import linear_cross_entropy

    def fn(hidden, weight, labels, temperature):
        h = hidden if temperature == 1.0 else hidden / temperature
        nll = linear_cross_entropy(h, weight, labels, reduction="none", impl="torch_compile")
        return -nll, None

    return fn


def _load_fastcov_logprob(device: torch.device) -> Fn:
    """fastcov's twin asked for what CCE gives: log-probs only (the entropy output is not used, so its
    upstream gradient is None and the backward skips the entropy term)."""
    fn = _load_fastcov("torch")(device)

    def logprob_only(hidden, weight, labels, temperature):
        return fn(hidden, weight, labels, temperature)[0], None

    return logprob_only


_VERL_PKG = "_fastcov_bench_verl_kernel"


def _verl_device_stub() -> types.ModuleType:
    stub = types.ModuleType("verl.utils.device")
    stub.is_cuda_available = torch.cuda.is_available()
    stub.get_device_name = lambda: "cuda" if torch.cuda.is_available() else "cpu"
    stub.get_torch_device = lambda: torch.cuda
    stub.get_device_capability = (
        lambda device_id=0: torch.cuda.get_device_capability(device_id) if torch.cuda.is_available() else (None, None)
    )
    stub.get_device_id = lambda: torch.cuda.current_device() if torch.cuda.is_available() else 0
    return stub


def _exec_module(name: str, path: Path, *, package_dir: Path | None = None) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(package_dir)] if package_dir else None
    )
    if spec is None or spec.loader is None:
        raise Unavailable(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_verl_linear_cross_entropy():
    """verl's fused (logprob, entropy) autograd function, loaded without ``import verl``."""
    if _VERL_PKG + ".linear_cross_entropy" in sys.modules:
        return sys.modules[_VERL_PKG + ".linear_cross_entropy"].linear_cross_entropy
    spec = importlib.util.find_spec("verl")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("not installed (pip install verl)")
    kdir = Path(list(spec.submodule_search_locations)[0]) / "utils" / "kernel"
    for f in ("kernels.py", "linear_cross_entropy.py"):
        if not (kdir / f).is_file():
            raise Unavailable(f"this verl has no {kdir / f}")
    stub_names = ("verl", "verl.utils", "verl.utils.device")
    saved = {n: sys.modules[n] for n in stub_names if n in sys.modules}
    for n in ("verl", "verl.utils"):
        if n not in sys.modules:
            pkg = types.ModuleType(n)
            pkg.__path__ = []  # a namespace-less stub: nothing else can be imported from it
            sys.modules[n] = pkg
    sys.modules["verl.utils.device"] = _verl_device_stub()
    try:
        init = kdir / "__init__.py"
        pkg = (_exec_module(_VERL_PKG, init, package_dir=kdir) if init.is_file()
               else types.ModuleType(_VERL_PKG))
        pkg.__path__ = [str(kdir)]
        sys.modules[_VERL_PKG] = pkg
        pkg.kernels = _exec_module(_VERL_PKG + ".kernels", kdir / "kernels.py")
        lce = _exec_module(_VERL_PKG + ".linear_cross_entropy", kdir / "linear_cross_entropy.py")
        pkg.linear_cross_entropy = lce
    finally:
        for n in stub_names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
    return lce.linear_cross_entropy


def _load_verl(device: torch.device) -> Fn:
    if importlib.util.find_spec("verl") is None:
        raise Unavailable("not installed (pip install verl)")
    lce = load_verl_linear_cross_entropy()  # loads on CPU too: a broken file shows up as such
    if device.type != "cuda":
        raise Unavailable("needs CUDA (Triton GPU kernels); this run is on CPU")

    def fn(hidden, weight, labels, temperature):
        logprob, entropy = lce(hidden, weight, labels, float(temperature), "none")
        return logprob, entropy

    return fn


# --------------------------------------------------------------------------- registry

IMPLS: dict[str, Impl] = {
    "naive": Impl("naive", "PyTorch, materialized fp32 logits + log_softmax + autograd", True,
                  lambda d: None, _load_naive, needs_cuda=False),
    "naive-compile": Impl("naive-compile", "the naive loop through torch.compile (inductor)", True,
                          lambda d: None, _load_naive_compiled, needs_cuda=False, compiles=True),
    "fastcov-triton": Impl("fastcov-triton", 'fastcov.linear_logprob_entropy(impl="triton")', True,
                           _probe_fastcov("triton"), _load_fastcov("triton")),
    "fastcov-torch": Impl("fastcov-torch", 'fastcov.linear_logprob_entropy(impl="torch")', True,
                          _probe_fastcov("torch"), _load_fastcov("torch"), needs_cuda=False),
    "liger": Impl("liger", 'Liger fused linear CE, reduction="none" (logprob only)', False,
                  _probe_peer("liger_kernel", "liger-kernel"), _load_liger),
    "liger-entropy": Impl("liger-entropy", "Liger fused linear scaled CE, return_entropy=True", True,
                          _probe_peer("liger_kernel", "liger-kernel"), _load_liger_entropy),
    "cce": Impl("cce", 'Cut Cross-Entropy, reduction="none", default filter_eps="high" (logprob only)', False,
                _probe_peer("cut_cross_entropy", "cut-cross-entropy"), _load_cce("high")),
    "cce-exact": Impl("cce-exact", "Cut Cross-Entropy with filter_eps=None (no gradient filtering)", False,
                      _probe_peer("cut_cross_entropy", "cut-cross-entropy"), _load_cce(None)),
    "cce-torch-compile": Impl("cce-torch-compile", 'Cut Cross-Entropy impl="torch_compile" (logprob only; runs on CPU)',
                              False, lambda d: None if importlib.util.find_spec("cut_cross_entropy") else
                              "not installed (pip install cut-cross-entropy)", _load_cce_torch_compile,
                              needs_cuda=False, compiles=True),
    "fastcov-torch-logprob": Impl("fastcov-torch-logprob", "fastcov's twin, log-probs only (as the CCE rows)", False,
                                  _probe_fastcov("torch"), _load_fastcov_logprob, needs_cuda=False),
    "verl": Impl("verl", "verl utils/kernel linear_cross_entropy (logprob + entropy)", True,
                 _probe_peer("verl", "verl"), _load_verl),
}
for _impl in ("triton", "torch"):
    for _switch, _kw in SWITCH_ROWS.items():
        _name = f"fastcov-{_impl}-{_switch}"
        IMPLS[_name] = Impl(_name, f'fastcov.linear_logprob_entropy(impl="{_impl}", {_switch})', True,
                            _probe_fastcov(_impl), _load_fastcov(_impl, _switch), needs_cuda=_impl == "triton")

DEFAULT_IMPLS = ["naive", "fastcov-triton", "fastcov-torch", "liger", "liger-entropy", "cce", "verl"]
