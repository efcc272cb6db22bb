"""``rollout.seeding: per_sample``: the samples do not depend on the topology.

Each response is drawn from its own generator, seeded by (run seed, step, global prompt index, sample
index), so how prompts are batched, and on which rank or node copy, changes no draw. The HF engine: the same
prompts in one call, one by one, or split over calls of other shapes give the same tokens (and, without per-sample
seeds, they do not: the test can tell). The trainer on 1 and 2 ranks, on one host and on two:
tests/trainer/e2e/test_topology_e2e.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


def test_sample_seed_is_a_function_of_its_key():
    from fastcov.trainer.rollout.base import sample_seed

    keys = [(s, t, g, j) for s in (0, 1) for t in (1, 2) for g in range(4) for j in range(3)]
    seeds = [sample_seed(*k) for k in keys]
    assert seeds == [sample_seed(*k) for k in keys]
    assert len(set(seeds)) == len(keys)
    assert all(0 <= s < 2**63 for s in seeds)


def _tiny_engine(token_budget: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastcov.trainer.rollout.hf import HFRolloutEngine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    return HFRolloutEngine(Qwen2ForCausalLM(cfg), [0], 1, token_budget=token_budget)


def test_hf_per_sample_seeds_do_not_depend_on_batching():
    from fastcov.trainer.rollout.base import SamplingParams, sample_seed

    prompts = [[5 + i] * (2 + i % 3) for i in range(6)]
    seeds = [sample_seed(0, 1, i // 2, i % 2) for i in range(6)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seeds=seeds)
    whole = _tiny_engine().generate(prompts, sp)
    alone = [_tiny_engine().generate([p], SamplingParams(1.0, 1.0, 12, [s])) for p, s in zip(prompts, seeds, strict=True)]
    small = _tiny_engine(token_budget=40).generate(prompts, sp)  # other batch shapes
    halves = [_tiny_engine().generate(prompts[sl], SamplingParams(1.0, 1.0, 12, seeds[sl]))
              for sl in (slice(0, 3), slice(3, 6))]
    for other in ([o.token_ids[0] for o in alone], small.token_ids, halves[0].token_ids + halves[1].token_ids):
        assert other == whole.token_ids
    for o, lp in zip(alone, whole.logprobs, strict=True):
        assert torch.allclose(torch.tensor(o.logprobs[0]), torch.tensor(lp), atol=1e-5)
    # one generator for the batch (rollout.seeding: batch): the split changes the draws
    g = [torch.Generator().manual_seed(0) for _ in range(3)]
    one = _tiny_engine().generate(prompts, SamplingParams(1.0, 1.0, 12), g[0])
    split = (_tiny_engine().generate(prompts[:3], SamplingParams(1.0, 1.0, 12), g[1]).token_ids
             + _tiny_engine().generate(prompts[3:], SamplingParams(1.0, 1.0, 12), g[2]).token_ids)
    assert split != one.token_ids


def test_vllm_server_sends_each_per_sample_seed_with_its_prompt():
    from fastcov.trainer.rollout.base import SamplingParams
    from fastcov.trainer.rollout.vllm_server import VLLMServerEngine

    calls = []

    def post(url, payload):
        if url.endswith("/v1/models"):
            return {"data": [{"id": "policy"}]}
        calls.append((url, payload))
        choices = [{"index": i, "logprobs": {"tokens": [f"token_id:{p[0] + 100}", "token_id:2"],
                                             "token_logprobs": [-1.0, -0.5]}} for i, p in enumerate(payload["prompt"])]
        return {"choices": choices}

    eng = VLLMServerEngine(["http://a:1", "http://b:2"], [2], tp=1, device=torch.device("cpu"), rank=1, post=post)
    out = eng.generate([[i, 7] for i in range(3)], SamplingParams(1.0, 1.0, 8, seeds=[11, 12, 13]))
    eng.close()
    assert out.token_ids == [[i + 100, 2] for i in range(3)]
    sent = sorted((p["prompt"][0][0], p["seed"], u) for u, p in calls)
    assert sent == [(0, 11, "http://a:1/v1/completions"), (1, 12, "http://a:1/v1/completions"),
                    (2, 13, "http://b:2/v1/completions")]
    assert all(len(p["prompt"]) == 1 for _, p in calls)
