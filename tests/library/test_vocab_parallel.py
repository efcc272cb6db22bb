"""The LM head split by vocabulary over 2 and 3 gloo processes (``linear_logprob_entropy(..., vocab_parallel=)``)
gives what one process gives on the whole head: log Z, log p(y), entropy, κ, Σπ², top-k, and the gradients of
hidden (all-reduced, or each rank's share) and of each rank's rows of the head and bias, with a per-token
temperature and a soft cap, through the PyTorch twin and the Triton kernels (interpreter)."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import free_port, read_rank_reports, report_rank, spawn_ranks

from fastcov import VocabParallel, linear_logprob_entropy
from fastcov.kernels.reference import reference_logprob_entropy

N, D = 23, 16
V = 101  # prime: no shard split divides it into tiles, and 3 ranks get unequal rows
TOPK = 4
SOFTCAP = 2.5
IGNORE = -100


def _inputs():
    g = torch.Generator().manual_seed(31)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * (3.0 / math.sqrt(D))
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = labels[11] = IGNORE
    temperature = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    g_up = torch.randn(N, generator=g, dtype=torch.float64)
    e_up = torch.randn(N, generator=g, dtype=torch.float64)
    return hidden, weight, bias, labels, temperature, g_up, e_up


def _bounds(world: int, equal: bool) -> list[int]:
    """Shard boundaries: equal rows (V rounded down to a multiple of world, the head cut to it), or uneven."""
    if equal:
        local = V // world
        return [r * local for r in range(world + 1)]
    cuts = {2: [0, 60, V], 3: [0, 30, 71, V]}[world]
    return cuts


def _call(hidden, weight, bias, labels, temperature, impl, vocab_parallel=None, softcap=SOFTCAP):
    return linear_logprob_entropy(hidden, weight, labels, bias=bias, temperature=temperature, vocab_cov=True,
                                  sum_p2=True, topk=TOPK, softcap=softcap, impl=impl, vocab_parallel=vocab_parallel)


OUTPUTS = ("logprob", "entropy", "logsumexp", "vocab_cov", "sum_p2", "topk_logprob", "topk_index")


def _rank_body(world: int) -> dict:
    """One rank: every case on its shard; returns the outputs and gradients as lists."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hidden0, weight0, bias0, labels, temperature, g_up, e_up = _inputs()
    out: dict = {}
    for impl in ("torch", "triton"):
        for equal in (True, False):
            cuts = _bounds(world, equal)
            lo, hi = cuts[rank], cuts[rank + 1]
            hidden = hidden0.float().requires_grad_()
            shard = weight0[lo:hi].float().requires_grad_()
            shard_bias = bias0[lo:hi].float().requires_grad_()
            opts = (VocabParallel(dist.group.WORLD) if equal else
                    VocabParallel(dist.group.WORLD, start=lo, vocab_size=V, reduce_hidden_grad=False))
            res = _call(hidden, shard, shard_bias, torch.where(labels < cuts[-1], labels, IGNORE),
                        temperature.float(), impl, opts)
            (res.logprob.double() * g_up + res.entropy.double() * e_up).sum().backward()
            case = {name: getattr(res, name).tolist() for name in OUTPUTS}
            case.update(dh=hidden.grad.tolist(), dw=shard.grad.tolist(), db=shard_bias.grad.tolist())
            out[f"{impl}-{'equal' if equal else 'uneven'}"] = case
    return out


def _whole(world: int, equal: bool, impl: str) -> dict:
    """One process on the head the ranks together hold."""
    hidden0, weight0, bias0, labels, temperature, g_up, e_up = _inputs()
    top = _bounds(world, equal)[-1]
    hidden = hidden0.float().requires_grad_()
    weight = weight0[:top].float().requires_grad_()
    bias = bias0[:top].float().requires_grad_()
    res = _call(hidden, weight, bias, torch.where(labels < top, labels, IGNORE), temperature.float(), impl)
    (res.logprob.double() * g_up + res.entropy.double() * e_up).sum().backward()
    log_probs = reference_logprob_entropy(hidden0, weight0[:top], labels.clamp(0, top - 1), bias0[:top], temperature,
                                          softcap=SOFTCAP)["log_probs"].detach()
    return {**{name: getattr(res, name) for name in OUTPUTS}, "dh": hidden.grad, "dw": weight.grad, "db": bias.grad,
            "log_probs": log_probs}


# one process against world ranks: the same fp32 sums in another order (the partials' merge, dh summed over
# ranks), a few ulps of values near 1–10 and of gradient elements near 1
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_equals_one_process_on_the_whole_head(world, tmp_path):
    spawn_ranks(report_rank, (world, free_port(), str(tmp_path), _rank_body, world), world)
    reports = read_rank_reports(tmp_path, world)
    for key in reports[0]:
        impl, layout = key.split("-")
        equal = layout == "equal"
        cuts = _bounds(world, equal)
        ref = _whole(world, equal, impl)
        dh_sum = torch.zeros_like(ref["dh"], dtype=torch.float64)
        for rank, rep in enumerate(reports):
            got = rep[key]
            for name in OUTPUTS[:-1]:
                torch.testing.assert_close(torch.tensor(got[name]), ref[name].detach(), **TOL,
                                           msg=lambda m, n=name, r=rank, k=key: f"{k} rank {r} {n}: {m}")
            # the top-k ids are global ids of the whole head: their float64 log-probs are the top-k values
            picked = torch.tensor(got["topk_index"])
            torch.testing.assert_close(ref["log_probs"].gather(1, picked).float(), ref["topk_logprob"], **TOL)
            lo, hi = cuts[rank], cuts[rank + 1]
            torch.testing.assert_close(torch.tensor(got["dw"]), ref["dw"][lo:hi], **TOL)
            torch.testing.assert_close(torch.tensor(got["db"]), ref["db"][lo:hi], **TOL)
            dh = torch.tensor(got["dh"])
            if equal:  # all-reduced: every rank holds the whole gradient
                torch.testing.assert_close(dh, ref["dh"], **TOL)
            else:  # reduce_hidden_grad=False: each rank its own columns' share, summing to the whole
                dh_sum += dh.double()
        if not equal:
            torch.testing.assert_close(dh_sum.float(), ref["dh"], **TOL)
            # a share alone is not the whole: the test can tell the two modes apart
            assert not torch.allclose(torch.tensor(reports[0][key]["dh"]), ref["dh"], **TOL)


def test_vocab_parallel_refuses_what_it_cannot_do(monkeypatch):
    hidden, weight, labels = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    # a process without a group: an in-process trainer test earlier in the session keeps its 1-rank group until the
    # interpreter exits (trainer.runtime.distributed.shutdown_distributed), by design
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="torch.distributed"):
        linear_logprob_entropy(hidden, weight, labels, vocab_parallel=VocabParallel())
    monkeypatch.undo()
