"""The policy's head sees only the labelled positions (trainer/runtime/model.py, ``labelled_positions_stats``):
the values and gradients equal the float64 definition at every position, unlabelled ones give zeros, and the
fused kernel is called on the labelled rows alone."""

import pytest
import torch

import fastcov
from fastcov.kernels.reference import reference_logprob_entropy
from fastcov.trainer.runtime.model import labelled_positions_stats

B, T, D, V = 3, 11, 24, 1001  # 1001: no vocabulary tile divides it
# fp32 against float64: logits of magnitude ~|h||w| ~ 5 rounded at ~6e-8 relative, log-sum-exp over 1001 terms and
# κ's differences of products of probabilities; 2e-5 is ~100x the rounding of one such sum
ATOL = 2e-5


def inputs(seed: int, labelled: str = "some"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.3
    labels = torch.randint(0, V, (B, T), generator=g)
    if labelled == "some":  # a prompt of each row's own length, then the answer, then padding
        for row, (prompt, end) in enumerate(((4, 9), (1, 11), (7, 8))):
            labels[row, :prompt] = -100
            labels[row, end:] = -100
    elif labelled == "none":
        labels[:] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_float64_definition(temperature):
    hidden, weight, labels = inputs(0)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    got = labelled_positions_stats(h, w, labels, temperature=temperature, vocab_cov=True)
    g_up = torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    e_up = torch.randn(B, T, generator=torch.Generator().manual_seed(2))
    ((got.logprob * g_up).sum() + (got.entropy * e_up).sum()).backward()

    h64 = hidden.double().reshape(-1, D).requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    ref = reference_logprob_entropy(h64, w64, labels.reshape(-1), temperature=temperature)
    ((ref["logprob"] * g_up.reshape(-1).double()).sum() + (ref["entropy"] * e_up.reshape(-1).double()).sum()).backward()

    valid = labels != -100
    for name in ("logprob", "entropy", "vocab_cov"):
        assert torch.allclose(getattr(got, name).double(), ref[name].view(B, T), atol=ATOL), name
    assert torch.equal(got.logsumexp[~valid], torch.zeros(int((~valid).sum())))  # unscored: 0, not a log Z
    assert torch.allclose(got.logsumexp[valid].double(), ref["logsumexp"].view(B, T)[valid], atol=ATOL)
    assert torch.allclose(h.grad.double(), h64.grad.view(B, T, D), atol=ATOL)
    assert torch.allclose(w.grad.double(), w64.grad, atol=ATOL * B * T)  # dW sums over the B·T positions
    assert torch.equal(h.grad[~valid], torch.zeros(int((~valid).sum()), D))


def test_the_head_sees_the_labelled_rows_only(monkeypatch):
    rows = []
    original = fastcov.linear_logprob_entropy

    def counting(hidden, *a, **k):
        rows.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return original(hidden, *a, **k)

    monkeypatch.setattr(fastcov, "linear_logprob_entropy", counting)
    for labelled, want in (("some", 5 + 10 + 1), ("all", B * T), ("none", B * T)):
        hidden, weight, labels = inputs(3, labelled)
        rows.clear()
        got = labelled_positions_stats(hidden, weight, labels)
        assert rows == [want], labelled
        direct = original(hidden, weight, labels)
        assert torch.allclose(got.logprob, direct.logprob, atol=ATOL)
        assert torch.allclose(got.entropy, direct.entropy, atol=ATOL)


def test_per_position_temperature_sum_p2_and_softcap_follow_the_gathered_rows():
    """A [B, T] temperature is gathered with the rows it belongs to (a shifted or ungathered one would score
    position t at another position's T), and Σπ² and the soft cap reach the head: the same as the whole call."""
    hidden, weight, labels = inputs(4)
    temperature = 0.5 + torch.rand(B, T, generator=torch.Generator().manual_seed(5))
    h = hidden.clone().requires_grad_(True)
    got = labelled_positions_stats(h, weight, labels, temperature=temperature, sum_p2=True, softcap=3.0)
    h_all = hidden.clone().requires_grad_(True)
    whole = fastcov.linear_logprob_entropy(h_all, weight, labels, temperature=temperature, sum_p2=True, softcap=3.0)
    for name in ("logprob", "entropy", "sum_p2"):
        assert torch.allclose(getattr(got, name), getattr(whole, name), atol=ATOL), name
    up = torch.randn(B, T, generator=torch.Generator().manual_seed(6))
    (got.logprob * up).sum().backward()
    (whole.logprob * up).sum().backward()
    assert torch.allclose(h.grad, h_all.grad, atol=ATOL)
    scalar = labelled_positions_stats(hidden, weight, labels, temperature=1.0, sum_p2=True, softcap=3.0)
    assert not torch.allclose(scalar.logprob, got.logprob, atol=1e-3)  # the per-position T does act
