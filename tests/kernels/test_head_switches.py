"""The fused head's switches beyond κ and top-k (issue 59), each against the float64 reference, values and
gradients, through the PyTorch twin and the Triton kernels (interpreter, fp32 and fp16):

* ``sum_p2=True``: Σπ² per token (no gradient), alone (the twin's s2-only path) and with κ;
* ``temperature`` as a tensor: one T per token, or one per sequence broadcast from [B, 1];
* ``softcap``: cap·tanh(z/cap) before the temperature (Gemma 2), forward and backward.

Odd shapes throughout: vocabularies no tile divides (1, 7, 71, 97, 1000, 4099), one token, ignore_index rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastcov import linear_logprob_entropy, logprob_entropy_from_logits
from fastcov.kernels.reference import reference_logprob_entropy

IGNORE = -100
# fp32 against float64: the existing kernel tests' tolerance (a D-long fp32 dot and a V-long fp32 sum per value;
# a gradient element's atol scales with the gradient's largest element, as there)
FP32 = dict(atol=2e-5, rtol=2e-4)
# fp16 inputs: the logits are exact in fp32 from fp16 values, dZ is rounded once to fp16 (2^-11 relative) before
# the gradient GEMMs, as in tests/kernels/test_linear_logprob_entropy.py
FP16 = dict(atol=3e-2, rtol=2e-2)


def _inputs(n, d, v, *, dtype=torch.float32, bias=True, seed=None, per_token=True, device="cpu"):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) / math.sqrt(d) * 3.0
    b = torch.randn(v, generator=gen) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    if n > 1:
        labels[1::4] = IGNORE
    temperature = (torch.rand(n, generator=gen) * 1.2 + 0.4) if per_token else 0.7  # T in [0.4, 1.6)
    g, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def leaf(t):
        return None if t is None else t.to(device=device, dtype=dtype).requires_grad_()

    temperature = temperature.to(device) if isinstance(temperature, torch.Tensor) else temperature
    return leaf(hidden), leaf(weight), leaf(b), labels.to(device), temperature, g.to(device), e.to(device)


def _check(hidden, weight, bias, labels, temperature, g, e, *, impl, tol, softcap=None, sum_p2=True, vocab_cov=True,
           topk=0, workspace_mb=None):
    out = linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=temperature, softcap=softcap,
                                 sum_p2=sum_p2, vocab_cov=vocab_cov, topk=topk, impl=impl, workspace_mb=workspace_mb)
    (out.logprob * g + out.entropy * e).sum().backward()
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref = reference_logprob_entropy(leaves[0], leaves[1], labels, leaves[2], temperature, IGNORE, softcap)
    (ref["logprob"] * g.double() + ref["entropy"] * e.double()).sum().backward()
    names = ["logprob", "entropy", "logsumexp"] + (["sum_p2"] if sum_p2 else []) + (["vocab_cov"] if vocab_cov else [])
    for name in names:
        torch.testing.assert_close(getattr(out, name).double(), ref[name].detach(), **tol,
                                   msg=lambda m, name=name: f"{name}: {m}")
    for got, leaf in zip((hidden.grad, weight.grad, None if bias is None else bias.grad), leaves, strict=True):
        if leaf is not None:
            scale = max(1.0, float(leaf.grad.abs().max()))
            torch.testing.assert_close(got.double(), leaf.grad, atol=tol["atol"] * scale, rtol=tol["rtol"])
    if topk:
        picked = ref["log_probs"].detach().gather(-1, out.topk_index)
        torch.testing.assert_close(out.topk_logprob.double(), picked, **tol)
        torch.testing.assert_close(picked, ref["log_probs"].detach().topk(topk, dim=-1).values, **tol)
    valid = labels != IGNORE
    assert torch.all(hidden.grad[~valid] == 0), "ignored rows get no gradient"
    if sum_p2:
        assert torch.all(out.sum_p2[~valid] == 0) and out.sum_p2.grad_fn is None
        v = weight.shape[0]
        assert torch.all(out.sum_p2[valid] >= 1.0 / v) and torch.all(out.sum_p2[valid] <= 1.0)
    return out


# ---------------------------------------------------------------- the twin

SHAPES = [(1, 8, 1), (1, 16, 7), (2, 16, 7), (33, 24, 1000), (17, 32, 4099)]
SWITCHES = {
    "sum_p2": dict(sum_p2=True, vocab_cov=False, per_token=False, softcap=None),
    "sum_p2+kappa": dict(sum_p2=True, vocab_cov=True, per_token=False, softcap=None),
    "per_token_T": dict(sum_p2=False, vocab_cov=False, per_token=True, softcap=None),
    "softcap": dict(sum_p2=False, vocab_cov=False, per_token=False, softcap=2.0),
    "all": dict(sum_p2=True, vocab_cov=True, per_token=True, softcap=2.0),
}


@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("n,d,v", SHAPES)
def test_twin_switches_match_float64(switch, n, d, v):
    sw = SWITCHES[switch]
    hidden, weight, bias, labels, temperature, g, e = _inputs(n, d, v, per_token=sw["per_token"])
    _check(hidden, weight, bias, labels, temperature, g, e, impl="torch", tol=FP32, softcap=sw["softcap"],
           sum_p2=sw["sum_p2"], vocab_cov=sw["vocab_cov"], topk=min(3, v))


@pytest.mark.parametrize("workspace_mb", [1e-4, 2e-3])
@pytest.mark.parametrize("bias", [True, False])
def test_twin_switches_in_many_chunks(workspace_mb, bias):
    """One-row backward chunks, one-column slabs, many forward chunks: the per-row 1/T and the cap's tanh slab
    follow every chunk and slab (sizes that divide nothing)."""
    hidden, weight, b, labels, temperature, g, e = _inputs(29, 12, 131, bias=bias)
    _check(hidden, weight, b, labels, temperature, g, e, impl="torch", tol=FP32, softcap=1.5, topk=5,
           workspace_mb=workspace_mb)


def test_softcap_with_logits_around_1e4_is_finite_and_exact():
    """A cap saturates ±1e4 logits at ±cap: finite, and still equal to float64 (the gradient there is ~0)."""
    hidden, weight, _, labels, temperature, g, e = _inputs(11, 16, 257, bias=False, seed=3)
    gen = torch.Generator().manual_seed(5)
    spread = ((torch.randint(0, 2, (257,), generator=gen) * 2 - 1) * 1e4).float().requires_grad_()
    out = _check(hidden, weight, spread, labels, temperature, g, e, impl="torch", tol=FP32, softcap=30.0)
    assert torch.isfinite(out.logprob).all() and torch.isfinite(weight.grad).all()


def test_per_token_temperature_equal_everywhere_is_the_scalar_call():
    hidden, weight, bias, labels, _, g, e = _inputs(21, 16, 97, seed=4, per_token=False)
    scalar = linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=0.7, impl="torch", sum_p2=True)
    tensor = linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=torch.full((21,), 0.7),
                                    impl="torch", sum_p2=True)
    for name in ("logprob", "entropy", "logsumexp", "sum_p2"):
        torch.testing.assert_close(getattr(tensor, name), getattr(scalar, name), atol=1e-6, rtol=1e-6)
    grads = [torch.autograd.grad((o.logprob * g + o.entropy * e).sum(), (hidden, weight, bias)) for o in (scalar, tensor)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_per_sequence_temperature_broadcasts_from_b_by_1():
    """[B, 1] temperatures (one per sequence) give what the [B, T] tensor of the same values gives, on [B, T, D]."""
    hidden, weight, bias, labels, _, g, e = _inputs(24, 16, 50, seed=6, per_token=False)
    per_seq = torch.tensor([[0.5], [0.8], [1.1], [1.4]])
    out_b1 = linear_logprob_entropy(hidden.view(4, 6, 16), weight, labels.view(4, 6), bias=bias, temperature=per_seq,
                                    impl="torch", sum_p2=True)
    full = per_seq.expand(4, 6).reshape(-1)
    out = _check(hidden, weight, bias, labels, full, g, e, impl="torch", tol=FP32)
    assert out_b1.logprob.shape == (4, 6) and out_b1.sum_p2.shape == (4, 6)
    torch.testing.assert_close(out_b1.logprob.reshape(-1), out.logprob.detach())
    torch.testing.assert_close(out_b1.sum_p2.reshape(-1), out.sum_p2)


def test_from_logits_takes_the_same_switches():
    hidden, weight, bias, labels, temperature, g, e = _inputs(21, 16, 97, seed=8)
    fused = linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=temperature, softcap=2.0,
                                   sum_p2=True, vocab_cov=True, impl="torch")
    logits = (hidden @ weight.T + bias).detach().requires_grad_()
    plain = logprob_entropy_from_logits(logits, labels, temperature=temperature, softcap=2.0, sum_p2=True,
                                        vocab_cov=True)
    for name in ("logprob", "entropy", "logsumexp", "vocab_cov", "sum_p2"):
        torch.testing.assert_close(getattr(plain, name), getattr(fused, name), **FP32)
    (plain.logprob * g + plain.entropy * e).sum().backward()
    (fused.logprob * g + fused.entropy * e).sum().backward()
    torch.testing.assert_close(logits.grad @ weight.detach(), hidden.grad, **FP32)


def test_sum_p2_is_verls_formula():
    """Σπ² = exp(logsumexp(2z) − 2·logsumexp(z)), as verl's calculate_sum_pi_squared_from_logits writes it."""
    hidden, weight, _, labels, _, _, _ = _inputs(9, 16, 301, bias=False, seed=9, per_token=False)
    labels = labels.clamp(min=0)
    out = linear_logprob_entropy(hidden, weight, labels, temperature=0.6, sum_p2=True, impl="torch")
    z = (hidden.detach().double() @ weight.detach().double().T) / 0.6
    verl_style = torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
    torch.testing.assert_close(out.sum_p2.double(), verl_style, **FP32)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(temperature=torch.ones(5)), ValueError, "temperature shape"),
        (dict(temperature=torch.tensor([1.0, 0.0, 1.0, 1.0])), ValueError, "temperature must be finite and > 0"),
        (dict(temperature=torch.tensor([1.0, float("nan"), 1.0, 1.0])), ValueError, "temperature must be finite"),
        (dict(temperature=torch.tensor([1.0, float("inf"), 1.0, 1.0])), ValueError, "temperature must be finite"),
        (dict(temperature=torch.tensor([1, 2, 1, 1])), TypeError, "temperature must be a floating tensor"),
        (dict(temperature="hot"), TypeError, "temperature"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=-30.0), ValueError, "softcap"),
        (dict(softcap=float("nan")), ValueError, "softcap"),
        (dict(softcap="30"), TypeError, "softcap"),
        (dict(softcap=True), TypeError, "softcap"),
    ],
)
def test_bad_switch_input_names_the_argument(change, error, match):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(16, 8), labels=torch.tensor([0, 3, IGNORE, 15]),
                temperature=1.0, impl="torch")
    args.update(change)
    with pytest.raises(error, match=match):
        linear_logprob_entropy(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)
    with pytest.raises(error, match=match):
        logits = torch.randn(4, 16)
        logprob_entropy_from_logits(logits, torch.tensor([0, 3, IGNORE, 15]),
                                    **{k: v for k, v in change.items()})


# ---------------------------------------------------------------- the Triton kernels (interpreter on CPU)

triton_kernels = pytest.importorskip("fastcov.kernels.linear_logprob_entropy")
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_kernels.interpreting()),
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("n,d,v,bias,workspace_mb", [
    (1, 16, 7, True, None), (19, 24, 71, True, None), (23, 40, 97, False, None),
    (37, 24, 71, True, 1e-3),  # backward chunks of a few rows: the per-row 1/T follows each chunk
])
def test_triton_switches_match_float64(dtype, switch, n, d, v, bias, workspace_mb):
    sw = SWITCHES[switch]
    hidden, weight, b, labels, temperature, g, e = _inputs(n, d, v, dtype=dtype, bias=bias, per_token=sw["per_token"],
                                                            device=DEVICE)
    out = _check(hidden, weight, b, labels, temperature, g, e, impl="triton",
                 tol=FP32 if dtype == torch.float32 else FP16, softcap=sw["softcap"], sum_p2=sw["sum_p2"],
                 vocab_cov=sw["vocab_cov"], topk=min(4, v), workspace_mb=workspace_mb)
    assert out.logprob.dtype == torch.float32 and hidden.grad.dtype == dtype


@needs_triton
def test_triton_and_twin_agree_with_every_switch():
    """The two backends on the same fp32 inputs, every switch on: the same numbers to fp32 rounding."""
    hidden, weight, bias, labels, temperature, _, _ = _inputs(26, 24, 203, seed=12, device=DEVICE)
    outs = [linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=temperature, softcap=4.0,
                                   sum_p2=True, vocab_cov=True, topk=3, impl=impl) for impl in ("torch", "triton")]
    for name in ("logprob", "entropy", "logsumexp", "vocab_cov", "sum_p2", "topk_logprob"):
        torch.testing.assert_close(getattr(outs[1], name), getattr(outs[0], name), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_bf16_softcap_and_per_token_temperature_on_gpu_are_no_less_exact_than_naive(monkeypatch):
    """bf16 is what the interpreter cannot check (its bf16 tl.dot is wrong): the Triton kernels at V 152064 with a
    cap of 30 and a temperature per token in [0.4, 1.6), dZ poisoned, against float64 on the same bf16 values, at
    least as close as the naive path (bf16 matmul → fp32 cap, T and log_softmax → autograd)."""
    monkeypatch.setattr(triton_kernels, "POISON", True)
    n, d, v, cap = 1000, 256, 152064, 30.0
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    hidden = torch.randn(n, d, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(v, d, generator=gen, device="cuda") * (3.0 / d ** 0.5)).bfloat16()
    labels = torch.randint(0, v, (n,), generator=gen, device="cuda")
    labels[::7] = IGNORE
    temperature = torch.rand(n, generator=gen, device="cuda") * 1.2 + 0.4
    g, e = torch.randn(n, generator=gen, device="cuda"), torch.randn(n, generator=gen, device="cuda")
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference_logprob_entropy(h64, w64, labels, None, temperature, IGNORE, cap)
    (ref["logprob"] * g.double() + ref["entropy"] * e.double()).sum().backward()

    def errors(lp, ent, dh, dw):
        rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
        return {"logprob": float((lp.detach().double() - ref["logprob"].detach()).abs().max()),
                "entropy": float((ent.detach().double() - ref["entropy"].detach()).abs().max()),
                "dh": rel(dh, h64.grad), "dw": rel(dw, w64.grad)}

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_logprob_entropy(h, w, labels, temperature=temperature, softcap=cap, impl="triton")
    (out.logprob * g + out.entropy * e).sum().backward()
    fused = errors(out.logprob, out.entropy, h.grad, w.grad)
    hn, wn = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = (hn @ wn.T).float()
    logp_all = torch.log_softmax(cap * torch.tanh(z / cap) / temperature[:, None], -1)
    valid = labels != IGNORE
    zero = torch.zeros(n, device="cuda")
    lp = torch.where(valid, logp_all.gather(-1, labels.clamp(min=0)[:, None])[:, 0], zero)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), zero)
    (lp * g + ent * e).sum().backward()
    naive = errors(lp, ent, hn.grad, wn.grad)
    for key in fused:
        assert fused[key] <= naive[key], (key, fused, naive)
