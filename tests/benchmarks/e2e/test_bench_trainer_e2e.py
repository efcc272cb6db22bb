"""bench/trainer/ end to end at the tiny preset: one line per trainer (fastcov's and TRL's), the suite's trainer part,
and case d's pretrained model from a tiny GGUF file (the forced long answer and the ratios:
tests/benchmarks/test_bench_trainer.py)."""

import json
import math

import pytest

from bench import trainer as B


@pytest.mark.slow
def test_tiny_run_writes_one_line_per_trainer(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert B.main(["--preset", "tiny", "--cases", "a", "--work", str(tmp_path / "work"), "--jsonl", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["trainer"] for r in rows] == ["fastcov", "trl"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["trainer"] for r in printed] == ["fastcov", "trl"]
    for r in rows:
        assert r["case"] == "a" and r["rollout_batches"] == 2 and r["optimizer_steps_per_batch"] == 2
        for key in ("step_s", "tokens_per_s", "peak_rss_mb", "rollout_s", "update_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["trainer"], key)
        assert 0.0 <= r["reward_first"] <= 1.0 and 0.0 <= r["reward_last"] <= 1.0
        assert r["machine"] and "load average" in r["load"] and len(r["per_step"]) == 2
        assert all(0 < s["peak_rss_mb"] <= r["peak_rss_mb"] for s in r["per_step"])
        assert 0 < r["mean_response_len"] <= r["max_new_tokens"] == 8
        # the held-out evaluation: the warm start's (the same in both lines) and the trained model's
        assert r["eval_before"] == rows[0]["eval_before"] and r["eval_settings"]["k"] == B.EVAL["k"]
        for ev in (r["eval_before"], r["eval_after"]):
            assert 0.0 <= ev["mean"] <= 1.0 and ev["se"] >= 0 and ev["prompts"] > 0
        # the training pool's: its prompts, POOL_K answers each
        assert r["pool"] == B.PRESETS["tiny"]["pool"] and r["pool_before"] == rows[0]["pool_before"]
        for ev in (r["pool_before"], r["pool_after"]):
            assert ev["prompts"] == r["pool"] and ev["k"] == B.POOL_K and 0.0 <= ev["mean"] <= 1.0
    # both trainers read the pool file: its rows are train.parquet's first ones
    import pandas as pd

    data = tmp_path / "work" / "data"
    pool = pd.read_parquet(B.train_pool(data, B.PRESETS["tiny"]))
    assert len(pool) == B.PRESETS["tiny"]["pool"]
    assert pool.equals(pd.read_parquet(data / "train.parquet").iloc[: len(pool)])


@pytest.mark.slow
def test_gpu_suite_trainer_part_at_smoke_size(tmp_path):
    from bench import gpu_suite as S

    assert S.main(["--parts", "trainer", "--size", "smoke", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for p in tmp_path.rglob("suite-*.jsonl") for line in p.read_text().splitlines()]
    (row,) = [r for r in rows if r.get("part") == "trainer" and r.get("name") == "bench.trainer"]
    assert row["status"] == "ok" and "a fastcov" in row["summary"] and "a trl" in row["summary"]


@pytest.mark.slow
def test_model_case_runs_a_gguf_model_on_its_own_task(tmp_path, monkeypatch):
    """Case d's code path (a pretrained model from a GGUF file, its chat-arithmetic task, its own sizes) on a tiny
    GGUF model instead of SmolLM2's 98 MB: one line per trainer, both on the converted model and its vocabulary."""
    pytest.importorskip("gguf")
    from _gguf import tiny_hf_model, write_gguf

    write_gguf(tiny_hf_model("llama", tied=True), tmp_path / "tiny.gguf")
    case = dict(B.MODEL_CASES["d"], model=str(tmp_path / "tiny.gguf"), level="d1o1",
                sizes=dict(prompts=2, n=4, max_new=6, long_new=6, mini_batches=2, lr=1e-4, steps=1, warmup=1,
                           pool=4, eval_prompts=4))
    monkeypatch.setitem(B.MODEL_CASES, "d", case)
    out = tmp_path / "out.jsonl"
    assert B.main(["--preset", "tiny", "--cases", "d", "--work", str(tmp_path / "work"), "--jsonl", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["trainer"], r["case"], r["case_name"]) for r in rows] == [("fastcov", "d", "smollm2"),
                                                                       ("trl", "d", "smollm2")]
    model = tmp_path / "work" / "smollm2" / "model"
    for r in rows:
        assert r["model"]["path"] == str(model) and r["model"]["vocab_size"] == 263 and r["prompts"] == 2
        assert r["task"] == "chat_arith d1o1" and r["rollout_batches"] == 2 and r["max_new_tokens"] == 6
        assert r["eval_before"]["prompts"] == 4 and r["pool_before"]["prompts"] == 4
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0
    assert (model / "gguf-source.json").is_file() and (tmp_path / "work" / "smollm2" / "data-d1o1" / "val.parquet").is_file()
