"""bench/trainer/: the forced long answer (case b) in both engines and the ratios (tiny runs end to end:
tests/benchmarks/e2e/test_bench_trainer_e2e.py)."""


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


def test_gpu_suite_part_is_registered_outside_the_default_order():
    from bench import gpu_suite as S

    assert "trainer" in S.PARTS and "trainer" in S.PARTS_ORDER and "trainer" not in S.RUN_ORDER
    assert all("trainer" in caps for caps in S.PART_CAPS.values())
    assert "gpu-1.5b" in B.PRESETS and B.PRESETS["gpu-1.5b"]["device"] == "cuda"
