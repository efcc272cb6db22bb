"""One HF rollout copy per node under ZeRO-3 (NodeRolloutEngine), on 2 local gloo processes: the node's
first rank samples for both, each rank gets back exactly the responses to its own prompts (equal to the
holder's engine sampling all the prompts in one call with the same generator), the other rank holds no
model, and with each rank on its own "node" (FASTCOV_NODE) each holds its own copy."""

import json
import os

import pytest
import torch
from _dist import free_port, shutdown_process_group, spawn_ranks

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from _fixtures import prompts_of, tiny_lm


def _worker(rank: int, world: int, port: int, out_dir: str, per_rank_node: bool) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    if per_rank_node:
        os.environ["FASTCOV_NODE"] = f"node{rank}"
    import torch.distributed as dist

    from fastcov.trainer.rollout import HFRolloutEngine, NodeRolloutEngine, SamplingParams, node_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group, ranks = node_group(rank, world)
    holder = rank == ranks[0]
    engine = HFRolloutEngine(tiny_lm(), [3], 0) if holder else None
    node = NodeRolloutEngine(engine, group, ranks, torch.device("cpu"))
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12)
    # rank 0: 3 prompts then none; rank 1: 5 prompts then 2 (different lengths, so results can't be swapped)
    calls = [prompts_of([4, 9, 2], seed=10 + rank * 7), []] if rank == 0 else \
        [prompts_of([6, 1, 8, 3, 5], seed=11), prompts_of([7, 2], seed=12)]
    gen = torch.Generator().manual_seed(1234 + rank)
    outs = [node.generate(p, sampling, gen) for p in calls]
    # the weight sync: every rank walks the iterable, only the holder copies
    walked = []
    fresh = tiny_lm(seed=5)

    def produce():
        for name, t in fresh.named_parameters():
            walked.append(name)
            yield name, t.detach()

    node.update_weights(produce())
    synced = holder and all(torch.equal(p, dict(fresh.named_parameters())[n])
                            for n, p in engine.model.named_parameters())
    result = {"ranks": ranks, "holder": holder, "holds_copy": node.holds_copy,
              "calls": calls, "token_ids": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
              "stats": node.last_stats, "walked": len(walked), "n_params": len(list(fresh.parameters())),
              "synced": synced}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    shutdown_process_group()


def _reference(calls_by_rank, ranks, seed):
    """The holder's engine sampling, per call, the node's prompts in rank order with its own generator, on one
    thread as the ranks do (with two, a reduction's last bit can differ: the test failed when run alone,
    and passed in the full suite only because an earlier test had left this process on one thread)."""
    from fastcov.trainer.rollout import HFRolloutEngine, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = HFRolloutEngine(tiny_lm(), [3], 0)
        gen = torch.Generator().manual_seed(seed)
        per_call = []
        for c in range(len(calls_by_rank[ranks[0]])):
            flat = [p for r in ranks for p in calls_by_rank[r][c]]
            per_call.append(engine.generate(flat, SamplingParams(1.0, 1.0, 12), gen))
    finally:
        torch.set_num_threads(threads)
    return per_call


@pytest.mark.slow
@pytest.mark.parametrize("per_rank_node", [False, True], ids=["one-node", "two-nodes"])
def test_node_rollout_engine_two_processes(tmp_path, per_rank_node):
    spawn_ranks(_worker, (2, free_port(), str(tmp_path), per_rank_node), 2)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    calls = {r: res[r]["calls"] for r in range(2)}
    for r in range(2):
        assert res[r]["walked"] == res[r]["n_params"], "every rank must walk the whole weight sync"
    if per_rank_node:
        assert [x["ranks"] for x in res] == [[0], [1]]
        assert all(x["holds_copy"] and x["synced"] for x in res)
    else:
        assert [x["ranks"] for x in res] == [[0, 1], [0, 1]]
        assert res[0]["holds_copy"] and res[0]["synced"] and not res[1]["holds_copy"]
        assert res[0]["stats"] == res[1]["stats"] and res[0]["stats"]["tokens"] > 0
    for r in range(2):
        ranks = res[r]["ranks"]
        ref = _reference(calls, ranks, 1234 + ranks[0])
        for c, out in enumerate(ref):
            start = sum(len(calls[q][c]) for q in ranks if q < r)
            n = len(calls[r][c])
            assert res[r]["token_ids"][c] == out.token_ids[start:start + n]
            assert res[r]["logprobs"][c] == out.logprobs[start:start + n]
            assert len(res[r]["token_ids"][c]) == n
