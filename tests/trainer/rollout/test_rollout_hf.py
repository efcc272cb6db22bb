"""The built-in HF rollout engine: token-budget batches, finished rows leaving the batch, the policy's
own module shared under ZeRO 0-2, an empty copy under ZeRO-3, and bench/rollout.py at a tiny size."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from _agreement import greedy_agreement, top2_margin
from _fixtures import prompts_of, tiny_lm

from fastcov.trainer.rollout import (
    HFRolloutEngine,
    SamplingParams,
    rollout_copy,
    token_budget_batches,
)


def policy_logprobs(model, prompt, ids):
    """The model's own log-probs of ``ids`` after ``prompt`` (temperature 1), fp32 [len(ids)]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


@pytest.mark.parametrize("budget,max_rows", [(0, 0), (100, 0), (60, 3), (1, 0)])
def test_token_budget_batches(budget, max_rows):
    lengths = [5, 17, 3, 9, 9, 30, 1]
    batches = token_budget_batches(lengths, 10, budget, max_rows)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert lengths[b[0]] == longest  # longest first
        if len(b) > 1:
            assert budget <= 0 or len(b) * (longest + 10) <= budget
            assert max_rows <= 0 or len(b) <= max_rows
    if budget == 0 and max_rows == 0:
        assert len(batches) == 1
    if budget == 1:
        assert all(len(b) == 1 for b in batches)


def test_greedy_equals_model_generate_while_rows_leave():
    """Greedy decoding with rows dropping out at eos gives exactly model.generate's tokens, and the
    sampling log-probs of the policy; prompts of different lengths in several budget batches."""
    model = tiny_lm().eval()
    prompts = prompts_of([5, 9, 2, 7, 7, 11])
    engine = HFRolloutEngine(model, [3], 0, token_budget=45, shares_policy=True)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=20))
    lengths = [len(x) for x in out.token_ids]
    assert len(set(lengths)) > 1 and min(lengths) < 20, lengths  # rows did finish at different steps
    assert engine.last_stats["tokens"] == sum(lengths) and engine.last_stats["tokens_per_s"] > 0
    refs, margins = [], []
    for p in prompts:
        gen = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=20, eos_token_id=3, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        ref = gen.sequences[0, len(p):].tolist()
        if 3 in ref:
            ref = ref[: ref.index(3) + 1]
        refs.append(ref)
        margins.append([top2_margin(s[0]) for s in gen.scores])
    # batched with padding against one prompt at a time: the same tokens but where generate's own top-2 margin is
    # within fp32 rounding of a tie (a batch shape moves logits by ulps)
    agree = greedy_agreement(out.token_ids, refs, margins, eps=1e-4)
    assert agree["differ"] == 0 and agree["equal"] >= len(prompts) - 1, agree
    for p, ids, lps in zip(prompts, out.token_ids, out.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(lps), policy_logprobs(model, p, ids), atol=1e-5, rtol=1e-5)


def test_kv_cache_goes_by_the_name_the_installed_transformers_takes():
    """transformers 5.24 renamed the KV-cache argument to ``cache`` and warns on ``past_key_values``:
    the engine passes the accepted name (no deprecation warning), also through apply_fastcov's patch."""
    import inspect
    import warnings

    from fastcov.integrations.transformers import apply_fastcov
    from fastcov.trainer.rollout import kv_cache_argument

    model = tiny_lm().eval()
    accepted = inspect.signature(type(model).forward).parameters
    assert kv_cache_argument(model) in accepted
    prompts = prompts_of([5, 3, 8])
    ref = HFRolloutEngine(model, [3], 0, shares_policy=True).generate(prompts, SamplingParams(0.0, 1.0, 10))
    apply_fastcov(model)
    assert kv_cache_argument(model) in accepted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = HFRolloutEngine(model, [3], 0, shares_policy=True).generate(prompts, SamplingParams(0.0, 1.0, 10))
    assert out.token_ids == ref.token_ids
    cache_warnings = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not cache_warnings, cache_warnings


def test_sampling_is_reproducible_and_batching_independent_in_distribution():
    model = tiny_lm().eval()
    prompts = prompts_of([4, 6, 6, 3] * 3)
    engine = HFRolloutEngine(model, [3], 0, shares_policy=True)
    a = engine.generate(prompts, SamplingParams(1.0, 1.0, 12), torch.Generator().manual_seed(5))
    b = engine.generate(prompts, SamplingParams(1.0, 1.0, 12), torch.Generator().manual_seed(5))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    # each sampled token's log-prob is the policy's under temperature 1
    for p, ids, lps in zip(prompts, a.token_ids, a.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(lps), policy_logprobs(model, p, ids), atol=1e-5, rtol=1e-5)


def test_shared_policy_module_keeps_its_mode_and_gradients():
    model = tiny_lm().train()
    engine = HFRolloutEngine(model, [3], 0, shares_policy=True)
    engine.generate(prompts_of([4, 5]), SamplingParams(1.0, 1.0, 5), torch.Generator().manual_seed(0))
    assert model.training and all(p.requires_grad for p in model.parameters())
    # a shared engine's update_weights consumes the producer's iterable and copies nothing
    seen = []
    engine.update_weights((seen.append(n) or (n, p) for n, p in model.named_parameters()))
    assert len(seen) == len(list(model.parameters()))


def test_rollout_copy_is_empty_until_synced_then_equal():
    model = tiny_lm(seed=3).eval()
    copy = rollout_copy(model.config, torch.device("cpu"), torch.float32)
    assert copy is not model and not any(p is q for p, q in zip(copy.parameters(), model.parameters(), strict=True))
    engine = HFRolloutEngine(copy, [3], 0)
    engine.update_weights(list(model.named_parameters()) + list(model.named_buffers()))
    for (n, p), (m, q) in zip(copy.state_dict().items(), model.state_dict().items(), strict=True):
        assert n == m and torch.equal(p, q), n
    for (n, b), (_, c) in zip(copy.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(b, c), n
    prompts = prompts_of([5, 8])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    ref = HFRolloutEngine(model, [3], 0, shares_policy=True).generate(prompts, greedy)
    assert engine.generate(prompts, greedy).token_ids == ref.token_ids


def test_rollout_bench_runs_at_a_tiny_size(tmp_path):
    """bench/rollout.py end to end (both engines honour the forced lengths or it raises)."""
    from bench import rollout as R

    assert R.main(["--hidden", "32", "--layers", "1", "--vocab", "128", "--batch", "4", "--prompt-len", "12",
                   "--long-factor", "3", "--repeats", "1", "--device", "cpu", "--out", str(tmp_path)]) == 0
    (path,) = list(tmp_path.glob("*/rollout-*.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    cases = {(r["engine"], r["batch"]): r for r in rows if "batch" in r}
    assert set(cases) == {(e, b) for e in ("fastcov-hf", "hf-generate") for b in ("all-short", "one-long")}
    assert cases[("fastcov-hf", "one-long")]["tokens"] == 16 * 3 + 3 * 16
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] is not None for r in cases.values())
    assert {r["engine"] for r in rows if r.get("summary")} == {"fastcov-hf", "hf-generate"}
