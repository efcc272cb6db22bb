"""Global scope over a process group: 2 local gloo processes must reproduce one process on the
concatenated batch (covariance, both selections, and the summed gradients of every mode).

The ranks hold unequal numbers of rows, each rank splits its rows into 2 micro-batches, and rank 1's
generator is seeded differently from rank 0's (only group rank 0's seed may matter).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import free_port as _free_port
from _dist import spawn_ranks

from fastcov.covariance import token_covariance
from fastcov.losses import LossConfig, compute_global_selection, policy_loss
from fastcov.selection import select_random_in_band, select_top_covariance

WORLD_SIZE = 2
RANK_ROWS = [slice(0, 4), slice(4, 9)]  # unequal shares of a 9-row batch
CONFIG = LossConfig(
    clip_high=0.28,
    clip_cov_ratio=0.1,
    clip_cov_lb=-0.5,
    clip_cov_ub=1.5,
    kl_cov_ratio=0.05,
    entropy_coef=0.01,
    high_entropy_fraction=0.5,
    pos_adv_weight=0.7,
)
CASES = [
    ("vanilla", "seq-mean-token-mean"),
    ("clip_cov", "token-mean"),
    ("kl_cov", "token-mean"),
    ("kl_cov", "seq-mean-token-sum"),
]
GENERATOR_SEED = 7


def _full_batch():
    g = torch.Generator().manual_seed(2024)
    rows, cols = 9, 17
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    lengths[5] = 0
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    logprob = -3 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old_logprob = logprob + 0.4 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    advantages = (2 * torch.randn(rows, 1, generator=g, dtype=torch.float64)).expand(rows, cols) * mask
    entropy = 2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    tie_scores = torch.randint(-2, 3, (rows, cols), generator=g).to(torch.float64)  # many ties
    return logprob, old_logprob, advantages.contiguous(), mask, entropy, tie_scores


def _totals(mask):
    return int(mask.sum()), int((mask.sum(-1) > 0).sum())


def _run_case(mode, agg, batch, group, generator_seed, microbatches):
    """Selection of the (rank's) mini-batch once, then the loss summed over micro-batches."""
    logprob, old_logprob, advantages, mask, entropy, _ = batch
    full_mask = _full_batch()[3]
    global_tokens, global_seqs = _totals(full_mask)
    selection = compute_global_selection(
        logprob, old_logprob, advantages, mask, mode=mode, config=CONFIG, entropy=entropy, group=group,
        generator=torch.Generator().manual_seed(generator_seed),
    )  # fmt: skip
    lp = logprob.clone().requires_grad_(True)
    ent = entropy.clone().requires_grad_(True)
    total = 0.0
    for rows in torch.tensor_split(torch.arange(mask.shape[0]), microbatches):
        rows = slice(int(rows[0]), int(rows[-1]) + 1)
        loss, _ = policy_loss(
            lp[rows], old_logprob[rows], advantages[rows], mask[rows], mode=mode, agg=agg, scope="global",
            config=CONFIG, entropy=ent[rows], group=group, global_tokens=global_tokens, global_seqs=global_seqs,
            selection=selection.rows(rows),
        )  # fmt: skip
        total = total + loss
    grad_lp, grad_ent = torch.autograd.grad(total, (lp, ent))
    return {"cov": selection.cov, "high_entropy": selection.high_entropy, "grad_lp": grad_lp, "grad_ent": grad_ent}


def _compute_all(batch, group, generator_seed, microbatches):
    logprob, old_logprob, advantages, mask, entropy, tie_scores = batch
    results = {
        "covariance": token_covariance(logprob, advantages, mask, group=group),
        "top": select_top_covariance(tie_scores, mask, 0.15, group=group),
        "band": select_random_in_band(
            tie_scores, mask, 0.2, -1.5, 1.5, exclude=tie_scores == 0, group=group,
            generator=torch.Generator().manual_seed(generator_seed),
        ),  # fmt: skip
    }
    if os.environ.get("TRITON_INTERPRET") == "1":
        results["covariance_triton"] = token_covariance(logprob, advantages, mask, group=group, impl="triton")
    for mode, agg in CASES:
        results[f"{mode}/{agg}"] = _run_case(mode, agg, batch, group, generator_seed, microbatches)
    return results


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120)
    )
    try:
        batch = tuple(t[RANK_ROWS[rank]] for t in _full_batch())
        seed = GENERATOR_SEED if rank == 0 else GENERATOR_SEED + 1000  # rank 1's draw must be ignored
        results = _compute_all(batch, dist.group.WORLD, seed, microbatches=2)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _concat(values):
    if isinstance(values[0], dict):
        return {key: _concat([v[key] for v in values]) for key in values[0]}
    if values[0] is None:
        return None
    return torch.cat(values, dim=0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_equal_one_process_on_the_concatenated_batch(tmp_path):
    spawn_ranks(_worker, (_free_port(), str(tmp_path)), WORLD_SIZE)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    distributed = _concat(per_rank)
    single = _compute_all(_full_batch(), None, GENERATOR_SEED, microbatches=1)

    assert single["top"].sum() > 1 and single["band"].sum() > 1
    assert set(distributed) == set(single)
    for key, expected in single.items():
        if isinstance(expected, dict):
            for field, value in expected.items():
                if value is None:
                    assert distributed[key][field] is None, f"{key}.{field}"
                elif value.dtype == torch.bool:
                    assert torch.equal(distributed[key][field], value), f"{key}.{field}"
                else:
                    torch.testing.assert_close(
                        distributed[key][field], value, rtol=1e-12, atol=1e-12, msg=f"{key}.{field}"
                    )
        elif expected.dtype == torch.bool:
            assert torch.equal(distributed[key], expected), key
        else:
            torch.testing.assert_close(distributed[key], expected, rtol=1e-12, atol=1e-12, msg=key)
    assert single["clip_cov/token-mean"]["cov"].sum() > 1
    assert single["kl_cov/token-mean"]["cov"].sum() > 1
