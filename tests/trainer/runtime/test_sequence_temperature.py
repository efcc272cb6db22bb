"""Each sequence is scored at the temperature it was sampled with: a micro-batch of sequences sampled at different
temperatures hands the fused kernel one temperature per token (padded and packed rows), and every token's log-prob
and entropy equal a call on that sequence alone at its scalar temperature."""

from __future__ import annotations

import pytest
import torch

from fastcov.trainer.runtime.batch import Sequence, micro_batches

transformers = pytest.importorskip("transformers")


def _policy():
    from fastcov.trainer.runtime.model import PolicyModel

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return PolicyModel(transformers.AutoModelForCausalLM.from_config(config).float().eval())


def _seqs(temperatures):
    g = torch.Generator().manual_seed(3)
    out = []
    for i, t in enumerate(temperatures):
        prompt = torch.randint(3, 53, (2 + i % 3,), generator=g).tolist()
        response = torch.randint(3, 53, (3 + (2 * i) % 5,), generator=g).tolist()
        out.append(Sequence(prompt, response, [0.0] * len(response), group=i, temperature=t))
    return out


def _by_sequence(model, mb, res):
    return {si: (res.logprob[row, start:start + n], res.entropy[row, start:start + n])
            for si, (row, start, n) in zip(mb.seq_index, mb.spans, strict=True)}


@pytest.mark.parametrize("packing", [False, True])
def test_mixed_temperatures_score_each_sequence_at_its_own(packing):
    model = _policy()
    temps = [0.6, 1.0, 1.4, 0.6, 0.9]
    seqs = _seqs(temps)
    mbs = micro_batches(seqs, budget=10_000, pad_id=0, device=torch.device("cpu"), packing=packing)
    assert len(mbs) == 1 and isinstance(mbs[0].temperature, torch.Tensor)
    with torch.no_grad():
        mixed = _by_sequence(model, mbs[0], model(**mbs[0].model_inputs(), temperature=mbs[0].temperature))
        for i, s in enumerate(seqs):
            (alone,) = micro_batches([s], budget=10_000, pad_id=0, device=torch.device("cpu"), packing=packing)
            assert alone.temperature == temps[i]  # one sequence: its temperature as a float
            lp, ent = _by_sequence(model, alone, model(**alone.model_inputs(), temperature=temps[i]))[0]
            # the same fp32 sums over the vocabulary; the decoder's rows differ only by padding or packing
            torch.testing.assert_close(mixed[i][0], lp, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(mixed[i][1], ent, atol=2e-5, rtol=1e-5)
        # a sequence's tokens at another temperature differ: the test can tell
        (other,) = micro_batches([seqs[2]], budget=10_000, pad_id=0, device=torch.device("cpu"), packing=packing)
        lp_other, _ = _by_sequence(model, other, model(**other.model_inputs(), temperature=0.6))[0]
        assert (mixed[2][0] - lp_other).abs().max() > 1e-3


def test_shared_or_missing_temperature_stays_a_float():
    same = micro_batches(_seqs([0.7, 0.7, 0.7]), budget=10_000, pad_id=0, device=torch.device("cpu"))
    assert same[0].temperature == 0.7
    none = micro_batches(_seqs([None, None]), budget=10_000, pad_id=0, device=torch.device("cpu"))
    assert none[0].temperature is None


def test_reference_logprobs_take_each_sequences_temperature():
    """The reference / PRIME reward model's log-probs (``response_logprobs``) score a sequence at its own sampling
    temperature, as the policy's forward does, so log π − log π_ref compares like with like."""
    from fastcov.trainer.token_level.prime import response_logprobs

    model = _policy().eval()
    temps = [0.6, 1.4, None, 0.9]
    seqs = _seqs(temps)
    kw = {"budget": 10_000}
    mixed = response_logprobs(model, seqs, 0, torch.device("cpu"), kw, temperature=1.2)
    for i, s in enumerate(seqs):
        alone = response_logprobs(model, [s], 0, torch.device("cpu"), kw, temperature=1.2)[0]
        # a sequence with no recorded temperature in a mixed batch takes the first recorded one (0.6), alone the
        # default (1.2): compare it at 0.6
        expect = alone if temps[i] is not None else response_logprobs(
            model, [Sequence(s.prompt, s.response, s.sample_logprob, s.group)], 0, torch.device("cpu"), kw, 0.6)[0]
        # the same fp32 sums over the vocabulary; the decoder's rows differ only by padding
        torch.testing.assert_close(torch.tensor(mixed[i]), torch.tensor(expect), atol=2e-5, rtol=1e-5)
    at_default = response_logprobs(model, seqs[1:2], 0, torch.device("cpu"), kw, temperature=1.2)[0]
    scalar = response_logprobs(model, [Sequence(seqs[1].prompt, seqs[1].response, seqs[1].sample_logprob, 1)], 0,
                               torch.device("cpu"), kw, 1.2)[0]
    assert max(abs(a - b) for a, b in zip(at_default, scalar, strict=True)) > 1e-3  # 1.4 ≠ 1.2: the test can tell
