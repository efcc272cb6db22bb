"""The demo's entropy at the end is the mean of the last 10% of steps (the study's yardstick), so one noisy
step cannot decide a ratio the README quotes."""

import json
import random

import pytest

from fastcov.trainer.experiments.demo import verdict
from fastcov.trainer.experiments.report import summarize


def _write(run, entropies):
    run.mkdir()
    rows = [{"step": i + 1, "entropy": h, "reward_mean": 0.5} for i, h in enumerate(entropies)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_end_entropy_is_the_mean_of_the_last_tenth(tmp_path):
    rng = random.Random(7)
    ent = [0.4 - 0.002 * i + rng.uniform(-0.01, 0.01) for i in range(57)]
    ent[-1] = 0.9  # one noisy last step
    _write(tmp_path / "grpo", ent)
    s = summarize(tmp_path / "grpo")
    assert s["final_entropy"] == pytest.approx(sum(ent[-5:]) / 5)  # 57 // 10 = 5 steps
    assert s["first_entropy"] == ent[0]


def test_verdict_compares_end_entropies(tmp_path):
    _write(tmp_path / "grpo", [0.4] * 10 + [0.1] * 9 + [0.5])
    _write(tmp_path / "kl_cov", [0.4] * 18 + [0.25, 0.25])
    text = verdict([summarize(tmp_path / n) for n in ("grpo", "kl_cov")])
    # 20 steps: the end is the mean of the last 2 (0.1 and 0.5), not the last step's 0.5
    assert "GRPO entropy went 0.400 → 0.300 nats/token (did not collapse" in text
    assert "kl_cov end entropy 0.250 = 0.83× GRPO's" in text
