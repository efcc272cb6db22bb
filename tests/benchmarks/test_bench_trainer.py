"""bench/trainer/: the forced long answer (case b) in both engines, the ratios, and a tiny run end to end."""

import json
import math

import pytest
import torch

from bench import trainer as B

FILLER, MAX_NEW = 5, 12


def tiny_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=40, eos_token_id=0,
                               pad_token_id=1, bos_token_id=None, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def all_filler(rows):
    return [i for i, r in enumerate(rows) if len(r) == MAX_NEW and all(t == FILLER for t in r)]


PROMPTS = [[7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18], [19, 20]]


def test_force_long_in_fastcovs_engine():
    from fastcov.trainer.rollout import HFRolloutEngine, SamplingParams

    model = tiny_model()
    engine = HFRolloutEngine(model, [0], 1, shares_policy=True)
    force = B.ForceLong(model, FILLER)
    out = force.wrap(engine.generate)(PROMPTS, SamplingParams(1.0, 1.0, MAX_NEW), torch.Generator().manual_seed(0))
    assert all_filler(out.token_ids) == [2]  # the engine batches longest prompt first: prompt 2 is its row 0
    assert not force.active
    with torch.no_grad():  # outside generation the hooks leave the logits alone
        ids = torch.tensor([[7, 8, FILLER, FILLER]])
        assert torch.equal(model(ids).logits, model(ids).logits) and not (model(ids).logits[0, -1] == 0).all()


def test_force_long_in_generate():
    model = tiny_model()
    L = max(map(len, PROMPTS))
    ids = torch.ones((len(PROMPTS), L), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
    force = B.ForceLong(model, FILLER)
    torch.manual_seed(0)
    out = force.wrap(model.generate)(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=MAX_NEW,
                                     eos_token_id=0, pad_token_id=1, top_k=0)
    assert all_filler(out[:, L:].tolist()) == [0]


def test_ratios_are_other_over_fastcov():
    def row(trainer, step, rss):
        return {"trainer": trainer, "case": "a", "step_s": step, "rollout_s": step, "logprob_s": 0.0,
                "update_s": step, "tokens_per_s": 1 / step, "peak_rss_mb": rss}

    (r,) = B.ratios([row("fastcov", 1.0, 500.0), row("trl", 2.0, 1000.0)])
    assert r["speedup"] == 2.0 and r["peak_rss"] == 0.5 and r["tokens_per_s"] == 2.0 and r["logprob"] is None


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


def test_gpu_suite_part_is_registered_outside_the_default_order():
    from bench import gpu_suite as S

    assert "trainer" in S.PARTS and "trainer" in S.PARTS_ORDER and "trainer" not in S.RUN_ORDER
    assert all("trainer" in caps for caps in S.PART_CAPS.values())
    assert "gpu-1.5b" in B.PRESETS and B.PRESETS["gpu-1.5b"]["device"] == "cuda"


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
