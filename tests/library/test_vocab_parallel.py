"""The LM head split by vocabulary over 2 gloo processes gives what one process gives on the whole head."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _dist import free_port as _free_port

from fastcov import linear_logprob_entropy

N, D = 23, 16
V_LOCAL = 53  # 2 ranks x 53 = 106 vocabulary rows


def _inputs():
    g = torch.Generator().manual_seed(31)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(2 * V_LOCAL, D, generator=g, dtype=torch.float64) / 2
    labels = torch.randint(0, 2 * V_LOCAL, (N,), generator=g)
    labels[3] = -100
    g_up = torch.randn(N, generator=g, dtype=torch.float64)
    e_up = torch.randn(N, generator=g, dtype=torch.float64)
    return hidden, weight, labels, g_up, e_up


def _worker(rank, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from fastcov.kernels import linear_logprob_entropy_torch as twin
        from fastcov.kernels._autograd import VocabParallelLogprobEntropyFunction

        hidden, weight, labels, g_up, e_up = _inputs()
        hidden = hidden.float().requires_grad_()
        shard = weight[rank * V_LOCAL:(rank + 1) * V_LOCAL].float().requires_grad_()
        logprob, entropy, lse = VocabParallelLogprobEntropyFunction.apply(
            hidden, shard, labels, 0.7, -100, dist.group.WORLD, twin)
        (logprob.double() * g_up + entropy.double() * e_up).sum().backward()
        # numpy arrays travel by value; a tensor would be shared by a file descriptor that this process
        # must outlive, and it exits right after (the parent then reads 'connection reset by peer')
        queue.put((rank, *(t.detach().numpy() for t in (logprob, entropy, lse, hidden.grad, shard.grad))))
    finally:
        dist.destroy_process_group()



@pytest.mark.timeout(120)
def test_vocab_parallel_matches_single_process():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=100) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    hidden, weight, labels, g_up, e_up = _inputs()
    hidden = hidden.float().requires_grad_()
    weight = weight.float().requires_grad_()
    ref = linear_logprob_entropy(hidden, weight, labels, temperature=0.7, impl="torch")
    (ref.logprob.double() * g_up + ref.entropy.double() * e_up).sum().backward()
    for rank, *arrays in results:
        logprob, entropy, lse, dh, dw = (torch.from_numpy(a) for a in arrays)
        torch.testing.assert_close(logprob, ref.logprob.detach(), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(entropy, ref.entropy.detach(), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse, ref.logsumexp, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(dh, hidden.grad, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(dw, weight.grad[rank * V_LOCAL:(rank + 1) * V_LOCAL], atol=2e-6, rtol=1e-5)
