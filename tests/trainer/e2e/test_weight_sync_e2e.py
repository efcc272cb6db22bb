"""Bucketed weight sync under ZeRO-3 on two gloo processes: the rollout copy of every rank gets the gathered weights
bit for bit, one bounded bucket at a time (the buckets themselves: tests/trainer/runtime/test_weight_sync.py)."""

import json
from pathlib import Path

import pytest
import torch
from _dist import free_port as _free_port
from _dist import set_rank_environment, shutdown_process_group, spawn_ranks

ROOT = Path(__file__).resolve().parents[3]


def _zero3_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    set_rank_environment(rank, world, port)
    torch.set_num_threads(1)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from fastcov.trainer.config import load_config
    from fastcov.trainer.rollout import make_rollout_engine
    from fastcov.trainer.runtime.distributed import init_distributed
    from fastcov.trainer.runtime.model import PolicyModel, build_model, load_tokenizer
    from fastcov.trainer.runtime.policy import DeepSpeedPolicy

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"trainer.run_dir={out_dir}/run", "trainer.zero_stage=3", "trainer.device=cpu",
        "rollout.sync_bucket_mb=0.02", "rollout.hf_copies=rank"])  # every rank's copy is checked
    device = torch.device("cpu")
    rank, world = init_distributed(device)
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model)
    lm = build_model(cfg.model, device, torch.float32, tok)
    engine = DeepSpeedPolicy(PolicyModel(lm), cfg, device, world)
    rollout = make_rollout_engine(cfg, engine.policy.lm, tok, device=device, rank=rank, world=world, zero_stage=3)
    with torch.no_grad():  # the rollout copy must really be overwritten by the sync
        for p in rollout.model.parameters():
            p.fill_(-7.0)
    lm_params = list(engine.policy.lm.parameters())
    cap = int(cfg.rollout.sync_bucket_mb * 2**20)
    stats = {"buckets": 0, "max_gathered": 0, "over_bound": 0, "names": []}

    def watch(buckets):
        for b in buckets:
            live = sum(p.ds_numel * p.element_size() for p in lm_params
                       if p.ds_status == ZeroParamStatus.AVAILABLE)
            stats["buckets"] += 1
            stats["max_gathered"] = max(stats["max_gathered"], live)
            stats["over_bound"] += int(live > cap and len(b) > 1)
            stats["names"] += b.names
            yield b

    rollout.update_weights(watch(engine.weight_buckets(cfg.rollout.sync_bucket_mb)))
    own = dict(rollout.model.named_parameters())
    max_diff, n = 0.0, 0
    for name, full in engine.named_weights():
        if name in own:
            n += 1
            max_diff = max(max_diff, float((own[name] - full).abs().max()))
    local = sum(p.ds_tensor.numel() for p in lm_params)
    total = sum(p.ds_numel for p in lm_params)
    idle = sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in lm_params)
    res = dict(stats, max_diff=max_diff, n=n, partitioned=local < total, total_bytes=total * 4,
               n_tensors=len(lm_params) + len(list(engine.policy.lm.buffers())), idle_gathered=idle)
    with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
        json.dump(res, f)
    shutdown_process_group()


@pytest.mark.slow
def test_zero3_two_process_bucketed_sync_matches_gathered_weights(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")

    spawn_ranks(_zero3_worker, (2, _free_port(), str(tmp_path)), 2)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["partitioned"], "ZeRO-3 should shard the parameters"
        assert res["n"] > 5 and res["max_diff"] == 0.0
        assert sorted(res["names"]) == sorted(set(res["names"])) and len(res["names"]) == res["n_tensors"]
        assert 1 < res["buckets"] < res["n_tensors"], res["buckets"]
        assert res["over_bound"] == 0, "a multi-tensor bucket gathered more than the bound"
        assert res["max_gathered"] < res["total_bytes"] / 2, "the whole model was gathered at once"
        assert res["idle_gathered"] == 0, "parameters left gathered after the sync"
