"""Two CPU processes, ZeRO-3, one training step and an evaluation: the node's one rollout copy (rank 0's;
rank 1 holds none) holds exactly the (gathered) policy weights after the weight sync, and the step
changed them; with rollout.hf_copies=rank each rank holds its own."""

import json
from pathlib import Path

import pytest
from _dist import free_port as _free_port
from _dist import set_rank_environment, shutdown_process_group, spawn_ranks
from _fixtures import odd_length_reward

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]



def _worker(rank: int, world: int, port: int, out_dir: str, copies: str) -> None:
    set_rank_environment(rank, world, port)
    import torch

    torch.set_num_threads(1)
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config
    from fastcov.trainer.rewards import RewardFn

    RewardFn.__call__ = odd_length_reward  # a spawned rank: no fixture reaches it
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"trainer.run_dir={out_dir}/run", "trainer.zero_stage=3", "trainer.max_steps=1",
        "trainer.eval_every=1", "reward.sandbox=inline", "algo.mini_batches=1", f"rollout.hf_copies={copies}",
    ])
    initial = {}
    from fastcov.trainer.rollout import HFRolloutEngine

    real_update = HFRolloutEngine.update_weights

    def spy(self, named):
        if not initial:  # the first sync copies the initial policy
            real_update(self, named)
            initial.update({n: p.detach().clone() for n, p in self.model.named_parameters()})
        else:
            real_update(self, named)

    HFRolloutEngine.update_weights = spy
    result = {}

    def on_end(engine, rollout):
        holder = getattr(rollout, "engine", rollout)  # NodeRolloutEngine: the node's copy, or None
        result.update(holds_copy=holder is not None)
        if holder is None:
            for _ in engine.named_weights():  # the gathers are collectives
                pass
            return
        own = dict(holder.model.named_parameters())
        max_diff, changed, n = 0.0, 0, 0
        for name, full in engine.named_weights():
            if name not in own:
                continue
            n += 1
            assert full.numel() > 0, f"{name} was not gathered"
            max_diff = max(max_diff, float((own[name] - full).abs().max()))
            changed += int(not torch.equal(own[name], initial[name]))
        # the rollout copy was built empty: its buffers (rotary frequencies) must have come with the sync
        policy_buffers = dict(engine.policy.lm.named_buffers())
        buffers_equal = all(torch.equal(b, policy_buffers[n]) for n, b in holder.model.named_buffers())
        local = sum(p.ds_tensor.numel() for p in engine.policy.parameters() if hasattr(p, "ds_tensor"))
        total = sum(p.ds_numel for p in engine.policy.parameters() if hasattr(p, "ds_numel"))
        result.update(max_diff=max_diff, changed=changed, n=n, partitioned=local < total,
                      buffers_equal=buffers_equal, shares=rollout.shares_policy)

    train_mod.train(cfg, on_end=on_end)
    with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
        json.dump(result, f)
    shutdown_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("copies", ["node", "rank"])
def test_two_process_zero3_step_syncs_rollout_weights(tmp_path, copies):
    spawn_ranks(_worker, (2, _free_port(), str(tmp_path), copies), 2)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["holds_copy"] == (copies == "rank" or rank == 0)
        if not res["holds_copy"]:
            continue
        assert res["partitioned"], "ZeRO-3 should shard the parameters"
        assert res["n"] > 5
        assert res["max_diff"] == 0.0 and res["buffers_equal"] and not res["shares"]
        assert res["changed"] > 0, "the optimizer step should have changed the weights"
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 1 and recs[-1]["applied_steps"] == 1
    assert 0.0 <= recs[-1]["val_acc"] <= 1.0
