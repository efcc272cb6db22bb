"""bench/logprob_profile.py: its two ways compute the same log-probs, so its times compare the same work."""

import random

import pytest
import torch

from bench import logprob_profile as L


def tiny_lm():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=53, eos_token_id=0,
                               pad_token_id=1, bos_token_id=None, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def sequences(n=13, seed=0):
    from fastcov.trainer.runtime.batch import Sequence

    rng = random.Random(seed)
    out = []
    for g in range(n):
        prompt = [rng.randrange(2, 53) for _ in range(rng.randint(3, 11))]
        answer = [rng.randrange(2, 53) for _ in range(rng.randint(1, 17))]
        out.append(Sequence(prompt, answer, [-1.0] * len(answer), g))
    return out


@pytest.mark.parametrize("budget, packing", [(8192, True), (40, True), (40, False)])
def test_fastcovs_pass_and_trls_way_give_the_same_logprobs(budget, packing):
    from fastcov.trainer.runtime.model import PolicyModel

    lm = tiny_lm()
    seqs = sequences()
    ours = L.fastcov_pass(PolicyModel(lm).eval(), seqs, 1, budget, packing, True)
    theirs = L.trl_pass(lm, seqs, 1, 4, False)
    assert [len(x) for x in ours] == [len(s.response) for s in seqs] == [len(x) for x in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert all(x < 0 for x in a)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
