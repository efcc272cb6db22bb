"""The fused vocabulary kernel (PyTorch twin and Triton kernels) against the float64 reference. Its peak memory
within the workspace budget, in a fresh process: tests/kernels/e2e/test_linear_logprob_entropy_e2e.py."""

import math
import os
import subprocess
import sys

import pytest
import torch
from _agreement import topk_agreement

import fastcov
from fastcov import linear_logprob_entropy, logprob_entropy_from_logits
from fastcov.kernels import linear_logprob_entropy_torch as twin
from fastcov.kernels.reference import reference_logprob_entropy

IGNORE = -100


def make_inputs(n, d, v, *, dtype=torch.float32, bias=True, ignore_every=4, scale=1.0, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    hidden = torch.randn(n, d, generator=gen) * scale
    weight = torch.randn(v, d, generator=gen) / math.sqrt(d) * 3.0
    b = torch.randn(v, generator=gen) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    if ignore_every and n > 1:
        labels[1::ignore_every] = IGNORE
    g = torch.randn(n, generator=gen)
    e = torch.randn(n, generator=gen)
    cast = lambda t: None if t is None else t.to(dtype).requires_grad_()  # noqa: E731
    return cast(hidden), cast(weight), cast(b), labels, g, e


def check_against_reference(hidden, weight, bias, labels, g, e, *, temperature, impl, atol, rtol, topk=0,
                            workspace_mb=None):
    out = linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=temperature,
                                 vocab_cov=True, topk=topk, impl=impl, workspace_mb=workspace_mb)
    (out.logprob * g + out.entropy * e).sum().backward()

    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    bias64 = None if bias is None else bias.detach().double().requires_grad_()
    ref = reference_logprob_entropy(leaves[0], leaves[1], labels, bias64, temperature, IGNORE)
    (ref["logprob"] * g.double() + ref["entropy"] * e.double()).sum().backward()

    for name in ("logprob", "entropy", "logsumexp", "vocab_cov"):
        torch.testing.assert_close(getattr(out, name).double(), ref[name].detach(), atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # a gradient element is a sum over tokens (dW, db) or the vocabulary (dh): its fp32 rounding grows with the
    # terms, so atol scales with the gradient's largest element (600 fresh draws at 33×24×1000: the plain
    # atol was exceeded up to 2.6×, this one used at most 0.29 of its allowance; a wrong gradient is off by O(1))
    for got, want in ((hidden.grad, leaves[0].grad), (weight.grad, leaves[1].grad),
                      (None if bias is None else bias.grad, None if bias is None else bias64.grad)):
        if want is not None:
            scale = max(1.0, float(want.abs().max()))
            torch.testing.assert_close(got.double(), want, atol=atol * scale, rtol=rtol)
    valid = labels != IGNORE
    assert torch.all(hidden.grad[~valid] == 0), "ignored rows must get no gradient"
    if topk:
        ref_top, ref_index = ref["log_probs"].detach().topk(topk, dim=-1)
        torch.testing.assert_close(out.topk_logprob.double(), ref_top, atol=atol, rtol=rtol)
        # indices may differ only where values tie within tolerance
        picked = ref["log_probs"].detach().gather(-1, out.topk_index)
        torch.testing.assert_close(picked, ref_top, atol=atol, rtol=rtol)
    return out


# ---------------------------------------------------------------- PyTorch twin, float32 vs float64

SHAPES = [(1, 8, 1), (1, 16, 7), (2, 16, 7), (33, 24, 1000), (17, 32, 4099)]


@pytest.mark.parametrize("n,d,v", SHAPES)
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
def test_twin_matches_float64(n, d, v, temperature):
    hidden, weight, bias, labels, g, e = make_inputs(n, d, v)
    check_against_reference(hidden, weight, bias, labels, g, e, temperature=temperature, impl="torch",
                            atol=2e-5, rtol=2e-4, topk=min(3, v))


@pytest.mark.parametrize("workspace_mb", [1e-4, 2e-3, 2e-2])
def test_twin_chunking_is_exact(workspace_mb):
    """Tiny budgets force one-row backward chunks, one-column scratch slabs and many forward chunks
    (sizes that divide nothing); the answer is the unchunked one."""
    hidden, weight, bias, labels, g, e = make_inputs(29, 12, 131)
    check_against_reference(hidden, weight, bias, labels, g, e, temperature=1.3, impl="torch",
                            atol=2e-5, rtol=2e-4, topk=5, workspace_mb=workspace_mb)


def test_twin_without_bias_and_batched_shape():
    hidden, weight, _, labels, g, e = make_inputs(24, 16, 50, bias=False)
    out3 = linear_logprob_entropy(hidden.view(4, 6, 16), weight, labels.view(4, 6), impl="torch", topk=2)
    assert out3.logprob.shape == (4, 6) and out3.topk_index.shape == (4, 6, 2)
    check_against_reference(hidden, weight, None, labels, g, e, temperature=1.0, impl="torch",
                            atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(out3.logprob.reshape(-1), linear_logprob_entropy(hidden, weight, labels).logprob)


def test_all_negative_logits():
    hidden, weight, _, labels, g, e = make_inputs(9, 16, 301, bias=False)
    bias = torch.full((301,), -40.0).requires_grad_()
    assert (hidden @ weight.T + bias).max() < 0
    # fp32 logits near -67 carry ~1e-5 rounding of their own, hence atol 5e-5
    out = check_against_reference(hidden, weight, bias, labels, g, e, temperature=0.6, impl="torch",
                                  atol=5e-5, rtol=2e-4)
    assert torch.isfinite(out.logprob).all()


def test_logits_around_1e4():
    """A shift of 1e4 leaves the distribution unchanged; ±1e4 spreads make it one-hot, not NaN."""
    hidden, weight, _, labels, g, e = make_inputs(11, 16, 257, bias=False, seed=3)
    base = linear_logprob_entropy(hidden, weight, labels, impl="torch")
    shifted = linear_logprob_entropy(hidden, weight, labels, bias=torch.full((257,), 1e4), impl="torch")
    torch.testing.assert_close(shifted.logprob, base.logprob, atol=5e-3, rtol=0)
    torch.testing.assert_close(shifted.entropy, base.entropy, atol=5e-3, rtol=0)

    gen = torch.Generator().manual_seed(5)
    spread = (torch.randint(0, 2, (257,), generator=gen) * 2 - 1) * 1e4 + torch.randn(257, generator=gen) * 50
    spread = spread.float().requires_grad_()
    check_against_reference(hidden, weight, spread, labels, g, e, temperature=1.3, impl="torch",
                            atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("v", [1, 2, 7, 1000])
def test_bounds_hold(v):
    hidden, weight, bias, labels, _, _ = make_inputs(40, 8, v, scale=4.0)
    out = linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=0.6, impl="torch")
    assert (out.logprob <= 0).all()
    assert (out.entropy >= 0).all() and (out.entropy <= math.log(v) + 1e-6).all()
    if v == 1:
        assert (out.logprob == 0).all() and (out.entropy == 0).all()


def test_entropy_false_and_logprob_only_gradient():
    hidden, weight, bias, labels, g, _ = make_inputs(10, 8, 33)
    out = linear_logprob_entropy(hidden, weight, labels, bias=bias, entropy=False, impl="torch")
    assert out.entropy is None and out.vocab_cov is None and out.topk_index is None
    (out.logprob * g).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = reference_logprob_entropy(h64, w64, labels, bias.detach().double())
    (ref["logprob"] * g.double()).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=2e-5, rtol=2e-4)


def test_from_logits_matches_linear():
    hidden, weight, bias, labels, g, e = make_inputs(21, 16, 97)
    fused = linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=0.6, vocab_cov=True,
                                   topk=4, impl="torch")
    logits = (hidden @ weight.T + bias).detach().requires_grad_()
    plain = logprob_entropy_from_logits(logits, labels, temperature=0.6, vocab_cov=True, topk=4)
    for name in ("logprob", "entropy", "logsumexp", "vocab_cov", "topk_logprob"):
        torch.testing.assert_close(getattr(plain, name), getattr(fused, name), atol=2e-5, rtol=2e-4)
    reference = torch.log_softmax(logits.detach().double() / 0.6, -1)
    agree = topk_agreement(fused.topk_index, reference, 4, eps=1e-5)
    assert agree["differ"] == 0 and agree["exact"] >= agree["rows"] - 1, agree  # the order, but at near-ties
    (plain.logprob * g + plain.entropy * e).sum().backward()
    (fused.logprob * g + fused.entropy * e).sum().backward()
    torch.testing.assert_close(logits.grad @ weight.detach(), hidden.grad, atol=2e-5, rtol=2e-4)


# ---------------------------------------------------------------- κ: the entropy polarity


def test_vocab_cov_predicts_entropy_change_of_a_logit_step():
    """ΔH ≈ −η·A·κ for the logit step Δz = η·A·(e_y − π); the gap shrinks linearly with η."""
    hidden, weight, bias, labels, _, _ = make_inputs(16, 16, 211, ignore_every=0, seed=11)
    temperature = 1.3
    kappa = linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=temperature,
                                   vocab_cov=True, impl="torch").vocab_cov.double()
    z = ((hidden.detach().double() @ weight.detach().double().T) + bias.detach().double()) / temperature
    adv = torch.randn(16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def entropy_of(logits):
        lp = torch.log_softmax(logits, -1)
        return -(lp.exp() * lp).sum(-1)

    onehot = torch.nn.functional.one_hot(labels, 211).double()
    gaps = []
    for eta in (1e-2, 1e-3):
        step = eta * adv[:, None] * (onehot - torch.softmax(z, -1))
        actual = entropy_of(z + step) - entropy_of(z)
        predicted = -eta * adv * kappa
        gaps.append(((actual - predicted).norm() / actual.norm()).item())
    assert gaps[1] < 1e-2
    assert 5 < gaps[0] / gaps[1] < 20, gaps


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(hidden=torch.randn(4)), ValueError, "hidden"),
        (dict(hidden=torch.randn(4, 8, dtype=torch.float64)), TypeError, "hidden"),
        (dict(hidden=torch.randn(4, 9)), ValueError, "D=8"),
        (dict(weight=torch.randn(16, 8, dtype=torch.float16)), TypeError, "weight dtype"),
        (dict(labels=torch.zeros(5, dtype=torch.int64)), ValueError, "labels shape"),
        (dict(labels=torch.zeros(4)), TypeError, "labels must be int64"),
        (dict(labels=torch.tensor([0, 1, 16, 2])), ValueError, "labels must be in"),
        (dict(labels=torch.tensor([0, -1, 3, 2])), ValueError, "labels must be in"),
        (dict(bias=torch.randn(15)), ValueError, "bias shape"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(topk=17), ValueError, "topk"),
        (dict(topk=-1), ValueError, "topk"),
        (dict(impl="cuda"), ValueError, "impl"),
    ],
)
def test_bad_input_names_the_argument(change, error, match):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(16, 8), labels=torch.tensor([0, 3, IGNORE, 15]),
                bias=None, temperature=1.0, topk=0, impl="torch")
    args.update(change)
    with pytest.raises(error, match=match):
        linear_logprob_entropy(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def test_triton_impl_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        linear_logprob_entropy(torch.randn(2, 8), torch.randn(5, 8), torch.tensor([0, 1]), impl="triton")
    # "auto" on CPU takes the twin
    out = linear_logprob_entropy(torch.randn(2, 8), torch.randn(5, 8), torch.tensor([0, 1]), impl="auto")
    assert out.logprob.shape == (2,)


def test_import_pulls_no_heavy_frameworks():
    code = "import sys, fastcov, fastcov.kernels; print(sorted(m for m in ('deepspeed','vllm','transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    assert fastcov.linear_logprob_entropy is linear_logprob_entropy


# ---------------------------------------------------------------- Triton kernels under the interpreter

triton_kernels = pytest.importorskip("fastcov.kernels.linear_logprob_entropy")
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_kernels.interpreting()),
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,d,v,temperature,bias,workspace_mb", [
    (1, 16, 7, 1.0, True, None), (19, 24, 71, 0.6, True, None), (23, 40, 97, 1.3, False, None),
    (37, 24, 71, 0.6, True, 1e-3),  # backward chunks of a few rows: dW accumulated over many GEMMs
])
def test_triton_matches_float64(dtype, n, d, v, temperature, bias, workspace_mb):
    hidden, weight, b, labels, g, e = make_inputs(n, d, v, dtype=dtype, bias=bias)
    to_dev = lambda t: None if t is None else t.detach().to(DEVICE).requires_grad_()  # noqa: E731
    hidden, weight, b = to_dev(hidden), to_dev(weight), to_dev(b)
    labels, g, e = labels.to(DEVICE), g.to(DEVICE), e.to(DEVICE)
    tol = dict(atol=2e-5, rtol=2e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    out = check_against_reference(hidden, weight, b, labels, g, e, temperature=temperature, impl="triton",
                                  topk=min(4, v), workspace_mb=workspace_mb, **tol)
    assert out.logprob.dtype == torch.float32 and hidden.grad.dtype == dtype and weight.grad.dtype == dtype


@needs_triton
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_triton_vocab_splits_combine_exactly(splits):
    """Splits that share the vocabulary (the last one may see no column at all: V=40, two tiles)."""
    hidden, weight, bias, labels, _, _ = make_inputs(18, 16, 40, seed=7)
    hidden, weight, bias, labels = (t.detach().to(DEVICE) for t in (hidden, weight, bias, labels))
    stats, (top_z, top_index) = triton_kernels.stats_forward(hidden, weight, bias, labels, 0.6, 3, splits=splits)
    ref_stats, (ref_top_z, ref_top_index) = twin.stats_forward(hidden, weight, bias, labels, 0.6, 3)
    assert torch.isfinite(stats[1:5]).all()
    from fastcov.kernels._stats import finalize

    valid = labels != IGNORE
    for got, want in zip(finalize(stats, valid, 40, True, True), finalize(ref_stats, valid, 40, True, True), strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(top_z, ref_top_z, atol=2e-5, rtol=2e-4)
    assert torch.equal(top_index, ref_top_index)


@needs_triton
def test_triton_forward_poisons_unwritten_partials(monkeypatch):
    """The launcher fills partials with NaN, so a kernel that skips a row cannot pass silently."""
    hidden, weight, _, labels, _, _ = make_inputs(20, 16, 33, bias=False, seed=1)
    hidden, weight, labels = (t.detach().to(DEVICE) for t in (hidden, weight, labels))
    real_kernel = triton_kernels._forward_kernel

    class SkipLastRows:  # launches the kernel on all but the last row block
        def __getitem__(self, grid):
            return real_kernel[(grid[0] - 1,) + tuple(grid[1:])]

    monkeypatch.setattr(triton_kernels, "_forward_kernel", SkipLastRows())
    monkeypatch.setattr(triton_kernels, "_forward_tuned", SkipLastRows())
    stats, _ = triton_kernels.stats_forward(hidden, weight, None, labels, 1.0, 0, splits=1)
    assert torch.isnan(stats[:, 16:]).all() and torch.isfinite(stats[:5, :16]).all()


@needs_triton
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_covariance_and_topk_switches_leave_logprob_and_entropy_alone(impl):
    """COV and TOPK are compile-time switches of the forward: off, the other outputs are unchanged."""
    hidden, weight, bias, labels, _, _ = make_inputs(19, 24, 71, seed=9)
    hidden, weight, bias, labels = (t.detach().to(DEVICE) for t in (hidden, weight, bias, labels))
    full = linear_logprob_entropy(hidden, weight, labels, bias=bias, vocab_cov=True, topk=3, impl=impl)
    lean = linear_logprob_entropy(hidden, weight, labels, bias=bias, impl=impl)
    assert lean.vocab_cov is None and lean.topk_index is None
    for name in ("logprob", "entropy", "logsumexp"):
        torch.testing.assert_close(getattr(lean, name), getattr(full, name), atol=1e-6, rtol=1e-6)


@needs_triton
def test_triton_backward_poisons_the_dz_buffer(monkeypatch):
    """The dZ buffer is NaN before each launch, so a kernel that skips a tile shows in dH and dW."""
    hidden, weight, _, labels, g, e = make_inputs(20, 16, 33, bias=False, seed=2, ignore_every=0)
    hidden, weight, labels, g, e = (t.detach().to(DEVICE) for t in (hidden, weight, labels, g, e))
    stats, _ = triton_kernels.stats_forward(hidden, weight, None, labels, 1.0, 0, want_cov=False)
    from fastcov.kernels._stats import finalize

    lse, _, ent, _, _ = finalize(stats, labels != IGNORE, 33, False)
    monkeypatch.setattr(triton_kernels, "POISON", True)
    dh, dw, _ = triton_kernels.grad_backward(hidden, weight, None, labels, 1.0, lse, ent, g, e)
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    real_kernel = triton_kernels._dz_kernel

    class SkipLastTile:  # launches the kernel on all but the last program
        def __getitem__(self, grid):
            return real_kernel[(grid[0] - 1,)]

    monkeypatch.setattr(triton_kernels, "_dz_kernel", SkipLastTile())
    monkeypatch.setattr(triton_kernels, "_dz_tuned", SkipLastTile())
    dh, dw, _ = triton_kernels.grad_backward(hidden, weight, None, labels, 1.0, lse, ent, g, e)
    assert torch.isnan(dh).any() and torch.isnan(dw).any()


# ---------------------------------------------------------------- workspace budget (its peak memory: e2e/)


def test_chunk_rows_fits_the_budget():
    from fastcov.kernels._workspace import chunk_rows

    v = 152064
    for budget_mb in (32, 256, 1000):
        for itemsize in (2, 4):
            rows = chunk_rows(65536, v, itemsize, budget_mb << 20, has_bias=True)
            assert rows * v * itemsize + 4 * v <= budget_mb << 20
            step = 64 if rows >= 128 else 1  # the largest such count (in whole GEMM tiles from 128 on)
            assert rows % step == 0 and (rows + step) * v * itemsize + 4 * v > budget_mb << 20
    assert chunk_rows(65536, v, 2, 256 << 20) == 832  # the docstring's 7B figure
    assert chunk_rows(65536, v, 2, 32 << 20) == 110  # below 128 rows: no rounding
    assert chunk_rows(10, v, 2, 256 << 20) == 10  # never more than N
    assert chunk_rows(10, v, 2, 1) == 1  # at least one row, whatever the budget


def test_workspace_budget_from_argument_and_environment(monkeypatch):
    from fastcov.kernels._workspace import workspace_bytes

    monkeypatch.delenv("FASTCOV_WORKSPACE_MB", raising=False)
    assert workspace_bytes() == 256 << 20
    assert workspace_bytes(32) == 32 << 20
    monkeypatch.setenv("FASTCOV_WORKSPACE_MB", "64")
    assert workspace_bytes() == 64 << 20 and workspace_bytes(32) == 32 << 20
    monkeypatch.setenv("FASTCOV_WORKSPACE_MB", "lots")
    with pytest.raises(ValueError, match="FASTCOV_WORKSPACE_MB"):
        workspace_bytes()
    monkeypatch.setenv("FASTCOV_WORKSPACE_MB", "-1")
    with pytest.raises(ValueError, match="FASTCOV_WORKSPACE_MB"):
        workspace_bytes()
    monkeypatch.delenv("FASTCOV_WORKSPACE_MB")
    for bad in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="workspace_mb"):
            linear_logprob_entropy(torch.randn(2, 8), torch.randn(5, 8), torch.tensor([0, 1]), workspace_mb=bad)
    with pytest.raises(TypeError, match="workspace_mb"):
        linear_logprob_entropy(torch.randn(2, 8), torch.randn(5, 8), torch.tensor([0, 1]), workspace_mb="32")


def test_no_atomics_in_the_kernel_files():
    kernel_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")
    for name in sorted(os.listdir(kernel_dir)):
        if name.endswith(".py"):
            with open(os.path.join(kernel_dir, name)) as f:
                assert "atomic_" not in f.read(), f"kernels/{name} uses an atomic"


@pytest.mark.parametrize("need", ["hidden", "weight"])
def test_gradient_of_one_input_only(need):
    """With only one of hidden/weight requiring grad, that one is right (the other GEMM is skipped)."""
    hidden, weight, _, labels, g, e = make_inputs(21, 16, 77, bias=False, seed=4)
    hidden.requires_grad_(need == "hidden")
    weight.requires_grad_(need == "weight")
    out = linear_logprob_entropy(hidden, weight, labels, temperature=0.6, impl="torch", workspace_mb=1e-3)
    (out.logprob * g + out.entropy * e).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = reference_logprob_entropy(h64, w64, labels, None, 0.6)
    (ref["logprob"] * g.double() + ref["entropy"] * e.double()).sum().backward()
    got, want = (hidden.grad, h64.grad) if need == "hidden" else (weight.grad, w64.grad)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-4)
    assert (weight.grad if need == "hidden" else hidden.grad) is None


# ---------------------------------------------------------------- bf16 precision at the Qwen2.5 vocabulary


def _errors(logprob, entropy, dh, dw, ref):
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    logprob, entropy = logprob.detach(), entropy.detach()
    return {"logprob": float((logprob.double() - ref["logprob"]).abs().max()),
            "entropy": float((entropy.double() - ref["entropy"]).abs().max()),
            "dh": rel(dh, ref["dh"]), "dw": rel(dw, ref["dw"])}


def _bf16_case(n, d, v, device, gen):
    hidden = torch.randn(n, d, generator=gen, device=device).bfloat16()
    weight = (torch.randn(v, d, generator=gen, device=device) * (3.0 / d ** 0.5)).bfloat16()
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    labels[::7] = IGNORE
    return hidden, weight, labels, torch.randn(n, generator=gen, device=device), torch.randn(n, generator=gen, device=device)


def _float64_truth(hidden, weight, labels, temperature, g, e):
    """logprob, entropy and the gradients of Σ g·logprob + e·entropy in float64 from the same bf16 values."""
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference_logprob_entropy(h64, w64, labels, None, temperature, IGNORE)
    (ref["logprob"] * g.double() + ref["entropy"] * e.double()).sum().backward()
    return {"logprob": ref["logprob"].detach(), "entropy": ref["entropy"].detach(), "dh": h64.grad, "dw": w64.grad}


def _naive_errors(hidden, weight, labels, temperature, g, e, ref):
    """The errors of bf16 matmul → fp32 log_softmax → autograd against ``ref``."""
    valid = labels != IGNORE
    hn, wn = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_all = torch.log_softmax((hn @ wn.T).float() / temperature, dim=-1)
    zero = torch.zeros(labels.shape[0], device=labels.device)
    lp = torch.where(valid, logp_all.gather(-1, labels.clamp(min=0)[:, None])[:, 0], zero)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), zero)
    (lp * g + ent * e).sum().backward()
    return _errors(lp, ent, hn.grad, wn.grad, ref)


def test_bf16_is_no_less_exact_than_the_naive_path_at_v_152064():
    """bf16 inputs, V = 152064 (no tile divides it), T = 0.7, ignore rows, and a 4-chunk backward
    (the dW accumulation across chunks is in bf16): the twin's logprob, entropy, dH and dW are at
    least as close to float64 as bf16 matmul → fp32 log_softmax → autograd."""
    n, d, v, temperature = 48, 64, 152064, 0.7
    hidden, weight, labels, g, e = _bf16_case(n, d, v, "cpu", torch.Generator().manual_seed(torch.seed() % 2**31))
    ref = _float64_truth(hidden, weight, labels, temperature, g, e)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    rows_per_chunk = 12  # 4 chunks
    out = linear_logprob_entropy(h, w, labels, temperature=temperature, impl="torch",
                                 workspace_mb=2 * rows_per_chunk * v * 2 / 2**20)
    (out.logprob * g + out.entropy * e).sum().backward()
    fused = _errors(out.logprob, out.entropy, h.grad, w.grad, ref)
    naive = _naive_errors(hidden, weight, labels, temperature, g, e, ref)
    for key in fused:
        assert fused[key] <= naive[key], (key, fused, naive)


# ---------------------------------------------------------------- GPU: the Triton path in bf16 (pytest -m gpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("workspace_mb", [None, 32])
def test_triton_bf16_on_gpu_is_no_less_exact_than_naive(monkeypatch, workspace_mb):
    """The Triton kernels in bf16 at V 152064 (T 0.7, ignore rows, dZ poisoned) against float64 and
    against the naive bf16 path; with 32 MiB the backward runs in several chunks."""
    monkeypatch.setattr(triton_kernels, "POISON", True)
    n, d, v, temperature = 1000, 256, 152064, 0.7
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    hidden, weight, labels, g, e = _bf16_case(n, d, v, "cuda", gen)
    ref = _float64_truth(hidden, weight, labels, temperature, g, e)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_logprob_entropy(h, w, labels, temperature=temperature, impl="triton", workspace_mb=workspace_mb)
    (out.logprob * g + out.entropy * e).sum().backward()
    fused = _errors(out.logprob, out.entropy, h.grad, w.grad, ref)
    valid = labels != IGNORE
    assert (out.logprob[valid] <= 0).all() and (out.logprob[~valid] == 0).all()
    naive = _naive_errors(hidden, weight, labels, temperature, g, e, ref)
    for key in fused:
        assert fused[key] <= naive[key], (key, fused, naive)


def test_twin_logprob_only_backward_skips_the_entropy_term_and_stays_exact():
    """Only log-probs need a gradient (e = 0): the twin's backward takes the short path, which must not
    read the entropy (poisoned with NaN here) and must match float64 at odd shapes and T != 1."""
    from fastcov.kernels._stats import dz_from_upstream

    gen = torch.Generator().manual_seed(3)
    z = torch.randn(5, 37, generator=gen, dtype=torch.float64).float()
    lse = torch.logsumexp(z.double(), 1).float()
    labels = torch.tensor([0, 36, 40, -3, 17])  # two rows whose label is outside this tile
    g = torch.randn(5, generator=gen)
    zero = torch.zeros(5)
    full = dz_from_upstream(z.clone(), lse, torch.rand(5), labels, g, zero, with_entropy=True)
    short = dz_from_upstream(z.clone(), lse, torch.full((5,), float("nan")), labels, g, zero, with_entropy=False)
    assert torch.isfinite(short).all()
    torch.testing.assert_close(short, full, atol=1e-6, rtol=1e-6)

    n, d, v, temperature = 13, 7, 131, 0.7
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=gen)
    leaves = [t.float().requires_grad_() for t in (hidden, weight)]
    out = linear_logprob_entropy(leaves[0], leaves[1], labels, temperature=temperature, impl="torch",
                                 workspace_mb=0.004)  # several row chunks and column slabs
    grads = torch.autograd.grad(out.logprob.sum(), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    ref = reference_logprob_entropy(ref_leaves[0], ref_leaves[1], labels, None, temperature, -100)
    ref_grads = torch.autograd.grad(ref["logprob"].sum(), ref_leaves)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-4)


def test_forward_autotune_key_has_every_switch_its_pruning_reads():
    """The forward's autotuner caches one config per key; its pruning picks the space from the input dtype and the
    bias, covariance and top-k switches. A switch missing from the key lets a config pruned for one setting
    (the 256×128 tile, offered without the covariance sums) be reused, from the cache, for another (where it spills)."""
    import inspect

    pytest.importorskip("triton")
    from fastcov.kernels import linear_logprob_entropy as K

    read_by_pruning = {"HAS_BIAS", "COV", "TOPK"}
    assert read_by_pruning <= set(inspect.signature(K._forward_kernel.fn).parameters)
    assert set(K._forward_tuned.keys) >= {"N_BUCKET", "V", "D", "SPLITS"} | read_by_pruning
    pruning = inspect.getsource(K._prune_forward)
    assert all(f'"{name}"' in pruning for name in read_by_pruning)
    # the spaces differ across those switches, so the key must tell them apart
    assert K.forward_space("bfloat16", cov=False) != K.forward_space("bfloat16", cov=True)
    assert K.forward_space("bfloat16", topk=4, cov=True) != K.forward_space("bfloat16", cov=True)
