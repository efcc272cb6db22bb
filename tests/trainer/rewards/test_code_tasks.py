"""Code tasks: format, answer extraction, the sandboxed test-running reward, a tiny run on the synthetic task."""

import sys

import pytest

from fastcov.trainer.rewards.code_task import (
    CodeRewardFn,
    code_row,
    extract_code,
    parse_tests,
    same_output,
    synthetic_code_tasks,
    write_code_task,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")


def test_format_and_extraction():
    row = code_row("double it", [("2\n", "4\n"), ("5\n", "10\n")])
    assert parse_tests(row["reward_model"]["ground_truth"]) == [("2\n", "4\n"), ("5\n", "10\n")]
    with pytest.raises(ValueError, match="inputs"):
        parse_tests('{"inputs": ["1"]}')
    text = "first\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\nbye"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("no code here") is None
    assert same_output("4  \n\n", "4\n") and not same_output("4\n5\n", "4\n")


def test_reward_runs_the_tests_in_the_sandbox():
    rows = synthetic_code_tasks(6, seed=3)
    fn = CodeRewardFn("binary", workers=2)
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    good = [f"here:\n```python\n{r['reference']}\n```" for r in rows]
    wrong = ["```python\nprint(0)\n```"] * len(rows)
    hostile = ["```python\nwhile True:\n    pass\n```"] + ["no code"] * (len(rows) - 1)
    assert fn.check_batch(good, truths) == [True] * len(rows)
    assert fn.check_batch(wrong, truths).count(True) <= 1  # print(0) might be right for one test set
    assert fn.check_batch(hostile, truths) == [False] * len(rows)
    assert fn.timeouts >= 1 and fn.statuses.get("cpu_limit", 0) + fn.statuses.get("timeout", 0) >= 1
    pm1 = CodeRewardFn("pm1")
    assert pm1.batch(good[:1] + wrong[:1], truths[:1] * 2)[0] == 1.0


def test_tiny_run_on_the_code_task(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.run_dir import read_metrics

    write_code_task(str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl"), n_train=16, n_val=4)
    cfg = load_config("configs/tiny.yaml", [
        f"trainer.run_dir={tmp_path / 'run'}", "reward.task=code", "data.synthetic.enabled=false",
        f"data.train_files=[{tmp_path / 'train.jsonl'}]", f"data.val_files=[{tmp_path / 'val.jsonl'}]",
        "trainer.max_steps=1", "trainer.eval_every=1", "algo.mode=vanilla"])
    run = train_mod.train(cfg)
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1] and recs[-1]["reward_mean"] == 0.0  # untrained: no code
