"""The trainer's entropy controller on 2 gloo ranks follows the 1-process run: it reads the entropy of the whole
rollout batch over all ranks (one process, the shaping, the warning and the errors:
tests/trainer/loop/test_entropy_control_trainer.py)."""

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from _fixtures import TINY, odd_length_reward

from fastcov.trainer import train as train_mod
from fastcov.trainer.config import load_config
from fastcov.trainer.rewards import RewardFn
from fastcov.trainer.runtime.run_dir import read_metrics

CONTROL = ["algo.entropy_control.target=50.0", "algo.entropy_control.knob=entropy_coef",
           "algo.entropy_control.rule=proportional", "algo.entropy_control.init=0.01", "algo.entropy_control.min=1e-4",
           "algo.entropy_control.max=0.9", "algo.entropy_control.gain=0.3"]


def _ranks_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import json

    from _dist import set_rank_environment, shutdown_process_group

    set_rank_environment(rank, world, port)
    torch.set_num_threads(1)
    RewardFn.__call__ = odd_length_reward  # a spawned rank: no fixture reaches it
    cfg = load_config(TINY, [f"trainer.run_dir={out_dir}/run", "trainer.max_steps=3", "reward.sandbox=inline",
                             "trainer.eval_every=0", "rollout.seeding=per_sample", *CONTROL])
    train_mod.train(cfg)
    Path(out_dir, f"done{rank}").write_text(json.dumps(True))
    shutdown_process_group()


@pytest.mark.slow
def test_controller_on_two_ranks_follows_one_process(tmp_path):
    """The controller reads the entropy of the whole rollout batch over all ranks: on 2 ranks (per-sample seeds, so
    the same samples) its values and errors equal the 1-process run's, up to the reduction order's rounding."""
    from _dist import free_port, spawn_ranks

    rows = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        out.mkdir()
        spawn_ranks(_ranks_worker, (world, free_port(), str(out)), world)
        rows[world] = read_metrics(out / "run" / "metrics.jsonl")
    one, two = rows[1], rows[2]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        for key in ("entropy", "entropy_control/value", "entropy_control/error"):
            assert math.isclose(a[key], b[key], rel_tol=1e-6), (a["step"], key, a[key], b[key])
    values = [r["entropy_control/value"] for r in one]
    assert values[0] == 0.01 and values[2] > values[1] > values[0]  # H ≈ 5 ≪ 50: the bonus grows
