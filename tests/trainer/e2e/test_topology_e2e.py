"""``rollout.seeding: per_sample`` in the trainer: the samples do not depend on the topology. ZeRO-3 with one HF copy
per node: 2 hosts x 1 rank and 1 host x 2 ranks (hosts from ``FASTCOV_NODE``) give bit-identical samples, metrics
and weights; 1 rank against 2 ranks identical samples and losses equal within float tolerance (the reductions add in
another order). The seeds and the HF engine: tests/trainer/rollout/test_topology.py; the 2-host case on real hosts
(network namespaces): tests/multinode."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _dist import free_port, set_rank_environment, shutdown_process_group, spawn_ranks

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]


def _worker(rank: int, world: int, port: int, out_dir: str, nodes: list[str], seeding: str) -> None:
    set_rank_environment(rank, world, port, FASTCOV_NODE=nodes[rank])
    torch.set_num_threads(1)
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"trainer.run_dir={out_dir}/run", "trainer.zero_stage=3", "trainer.max_steps=2",
        "reward.sandbox=inline", f"rollout.seeding={seeding}",
    ])
    samples = []
    real_collect = train_mod.collect_rollouts

    def recording(*args, **kwargs):
        col = real_collect(*args, **kwargs)
        samples.append(col.token_ids)
        return col

    train_mod.collect_rollouts = recording
    train_mod.train(cfg)
    (Path(out_dir) / f"samples{rank}.json").write_text(json.dumps(samples))
    shutdown_process_group()


def _run(tmp_path: Path, name: str, nodes: list[str], seeding: str = "per_sample") -> dict:
    out = tmp_path / name
    out.mkdir()
    spawn_ranks(_worker, (len(nodes), free_port(), str(out), nodes, seeding), len(nodes))
    per_rank = [json.loads((out / f"samples{r}.json").read_text()) for r in range(len(nodes))]
    steps = [[s for rank in per_rank for s in rank[i]] for i in range(len(per_rank[0]))]  # rank order = global
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    return {"samples": steps, "metrics": [{k: v for k, v in r.items() if not (k.startswith("time/") or "per_s" in k)}
                                          for r in rows],
            "weights": load_file(str(out / "run" / "final" / "model.safetensors"))}


@pytest.mark.slow
def test_per_sample_runs_do_not_depend_on_the_topology(tmp_path):
    two_hosts = _run(tmp_path, "2x1", ["host-a", "host-b"])
    one_host = _run(tmp_path, "1x2", ["host-a", "host-a"])
    one_rank = _run(tmp_path, "1x1", ["host-a"])
    assert two_hosts["samples"] == one_host["samples"]
    assert two_hosts["metrics"] == one_host["metrics"]
    assert all(torch.equal(two_hosts["weights"][k], one_host["weights"][k]) for k in two_hosts["weights"])
    assert one_rank["samples"] == one_host["samples"]
    for a, b in zip(one_rank["metrics"], one_host["metrics"], strict=True):
        assert a["step"] == b["step"]
        for k in ("loss", "entropy", "reward_mean", "response_len"):
            if k in a:
                assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (a["step"], k, a[k], b[k])
