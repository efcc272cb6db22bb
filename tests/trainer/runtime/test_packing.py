"""Sequence packing and token-budget micro-batches (trainer/runtime/batch.py, PolicyModel's packed inputs).

Packed rows (several sequences per row, position ids restarting per sequence, attention confined to
each sequence) must give the log-probs, entropies and gradients of one padded sequence per row, and
every micro-batch must respect the token budget.
"""

import random
from pathlib import Path

import pytest
import torch
from _agreement import fp32_loss_tolerance, loss_term_scale

pytest.importorskip("transformers")

from fastcov.trainer.config import load_config
from fastcov.trainer.runtime.batch import (
    IGNORE,
    Sequence,
    equalize,
    micro_batches,
    pack_rows,
    sequence_tensors,
)
from fastcov.trainer.runtime.model import PolicyModel, build_model, load_tokenizer, packed_attention

ROOT = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")


def _sequences(n=11, vocab=40, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
        out.append(Sequence(prompt, response, [0.0] * len(response), group=i // 4, advantage=rng.uniform(-1, 1),
                            old_logprob=[-float(k) for k in range(len(response))]))
    return out


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def policy(request):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"model.attn_implementation={request.param}"])
    tok = load_tokenizer(cfg.model)
    torch.manual_seed(0)
    lm = build_model(cfg.model, CPU, torch.float32, tok)
    assert lm.config._attn_implementation == request.param
    return PolicyModel(lm)


def _per_sequence(policy, seqs, width, **batching):
    """Log-probs and entropies [S, width] through micro_batches(**batching), and the micro-batches."""
    lp = torch.zeros(len(seqs), width)
    ent = torch.zeros(len(seqs), width)
    mbs = micro_batches(seqs, pad_id=0, device=CPU, **batching)
    for mb in mbs:
        res = policy(**mb.model_inputs(), temperature=0.7)
        mb.to_sequences(res.logprob, lp)
        mb.to_sequences(res.entropy, ent)
    return lp, ent, mbs


@pytest.mark.parametrize("budget, row_capacity", [(10_000, None), (60, None), (45, 45), (10_000, 10_000)])
def test_packed_logprobs_equal_padded(policy, budget, row_capacity):
    seqs = _sequences()
    width = max(len(s.response) for s in seqs)
    ref_lp, ref_ent, ref_mbs = _per_sequence(policy, seqs, width, budget=10_000)
    assert len(ref_mbs) == 1 and ref_mbs[0].input_ids.shape[0] == len(seqs)
    lp, ent, mbs = _per_sequence(policy, seqs, width, budget=budget, packing=True, row_capacity=row_capacity)
    rows_with_several = sum(
        1 for mb in mbs for r in range(mb.input_ids.shape[0]) if sum(row == r for row, _, _ in mb.spans) > 1
    )
    assert rows_with_several > 0, "nothing was packed"
    mask = sequence_tensors(seqs, width, CPU)["mask"]
    assert bool((lp[mask] < 0).all())
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


def test_packed_gradients_equal_padded(policy):
    seqs = _sequences(n=6, seed=3)
    width = max(len(s.response) for s in seqs)
    grads = []
    for packing in (False, True):
        policy.zero_grad()
        total = 0.0
        for mb in micro_batches(seqs, 10_000, 0, CPU, packing=packing):
            res = policy(**mb.model_inputs())
            weights = torch.arange(1.0, width + 1)[None].expand(len(seqs), width)
            total = total + (res.logprob * mb.from_sequences(weights.contiguous())).sum()
        total.backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("mode, agg", [("gspo", "token-mean"), ("gspo", "seq-mean-token-mean"), ("vespo", "token-mean")])
def test_packed_sequence_modes_equal_padded(policy, mode, agg):
    """GSPO's sequence ratio (the mean log-ratio over each sequence's own tokens), VESPO's (a sum) and the seq-*
    aggregations take a packed row's sequences one by one (``policy_loss(segments=mb.segment_ids())``): the loss and
    every gradient of packed micro-batches equal the padded ones'. Without the segments a packed row's sequences
    would share a ratio."""
    from fastcov.losses import LossConfig, policy_loss

    seqs = _sequences(n=8, seed=5)
    width = max(len(s.response) for s in seqs)
    ref_lp = _per_sequence(policy, seqs, width, budget=10_000)[0].detach()
    rng = random.Random(1)
    for i, s in enumerate(seqs):  # old log-probs near the policy's: ratios spread around 1, some past the clip
        s.old_logprob = [float(ref_lp[i, t]) + rng.gauss(0, 0.1) for t in range(len(s.response))]
    config = LossConfig(clip_low=0.05, clip_high=0.05)
    n_tok, n_seq = sum(len(s.response) for s in seqs), len(seqs)
    results = {}
    for packing, use_segments in ((False, True), (True, True), (True, False)):
        policy.zero_grad()
        total, packed_rows = 0.0, 0
        for mb in micro_batches(seqs, 10_000, 0, CPU, packing=packing):
            res = policy(**mb.model_inputs(), temperature=0.7)
            loss, _ = policy_loss(res.logprob, mb.old_logprob, mb.advantages, mb.mask, mode=mode, agg=agg,
                                  config=config, global_tokens=n_tok, global_seqs=n_seq,
                                  segments=mb.segment_ids() if use_segments else None)
            total = total + loss
            packed_rows += sum(1 for r in range(mb.input_ids.shape[0]) if sum(row == r for row, _, _ in mb.spans) > 1)
        total.backward()
        assert packing == (packed_rows > 0)
        results[packing, use_segments] = (float(total), {n: p.grad.clone() for n, p in policy.named_parameters()})
    loss, grads = results[False, True]
    packed_loss, packed_grads = results[True, True]
    mask = torch.arange(width)[None, :] < torch.tensor([len(s.response) for s in seqs])[:, None]
    scale = loss_term_scale(torch.tensor([s.advantage for s in seqs]), ref_lp, mask)
    # one evaluation summed in another order (VESPO's terms are |A·log π| and cancel): fp32 rounding of n terms
    assert abs(packed_loss - loss) <= fp32_loss_tolerance(n_tok, scale, 1), (packed_loss, loss)
    for name, g in grads.items():
        torch.testing.assert_close(packed_grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert abs(results[True, False][0] - loss) > 1e-4  # the segments matter


def test_packed_mask_is_block_diagonal_causal():
    # two sequences of 3 and 2 tokens, then 2 padding tokens (a segment of their own)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    allowed = packed_attention(pos, "sdpa", torch.float32)[0, 0]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for lo, hi in ((0, 3), (3, 5), (5, 7)):
        expected[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(allowed, expected)
    additive = packed_attention(pos, "eager", torch.float32)[0, 0]
    assert torch.equal(additive == 0, expected)
    assert packed_attention(pos, "flash_attention_2", torch.bfloat16) is None
    with pytest.raises(ValueError, match="one row per micro-batch"):
        packed_attention(pos.expand(2, -1), "flash_attention_2", torch.bfloat16)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("budget", [1, 12, 25, 40, 64, 1000])
def test_token_budget_is_respected(packing, budget):
    seqs = _sequences(n=17, seed=budget)
    mbs = micro_batches(seqs, budget, 0, CPU, packing=packing)
    seen = []
    for mb in mbs:
        rows, length = mb.input_ids.shape
        one_long_sequence = len(mb.seq_index) == 1 and len(seqs[mb.seq_index[0]]) > budget
        assert rows * length <= budget or one_long_sequence, (rows, length, budget)
        assert mb.packed == packing
        if not packing:
            assert [row for row, _, _ in mb.spans] == list(range(rows))  # one sequence per row
        for si, (row, start, n) in zip(mb.seq_index, mb.spans, strict=True):
            s = seqs[si]
            assert n == len(s.response)
            assert mb.labels[row, start : start + n].tolist() == s.response
            assert mb.old_logprob[row, start : start + n].tolist() == s.old_logprob
        assert int(mb.mask.sum()) == sum(len(seqs[i].response) for i in mb.seq_index)
        seen += mb.seq_index
    assert sorted(seen) == list(range(len(seqs)))
    if budget >= 1000:
        assert len(mbs) == 1


def test_packing_needs_fewer_tokens_than_padding():
    seqs = _sequences(n=17, seed=5)
    padded = sum(mb.input_ids.numel() for mb in micro_batches(seqs, 64, 0, CPU))
    packed = sum(mb.input_ids.numel() for mb in micro_batches(seqs, 64, 0, CPU, packing=True))
    assert packed < padded


def test_pack_rows_first_fit_decreasing():
    lengths = [5, 9, 3, 7, 2, 4]
    rows = pack_rows(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert rows == [[0, 5], [1], [2, 3], [4]] or len(rows) == 3  # 30 tokens need >= 3 rows of 10
    assert pack_rows([12, 3], 10) == [[0], [1]]  # too long: a row of its own


def test_equalize_splits_rows_then_sequences():
    assert equalize([[[0], [1], [2]]], 2) == [[[0]], [[1], [2]]]
    assert equalize([[[0, 1, 2]]], 2) == [[[0]], [[1, 2]]]  # one packed row splits between sequences
    assert equalize([[[0]]], 3) == [[[0]], [], []]  # no more to split: fillers


def test_filler_micro_batches_and_per_sequence_round_trip():
    seqs = _sequences(n=3)
    width = max(len(s.response) for s in seqs)
    per_seq = torch.arange(3 * width, dtype=torch.float32).view(3, width)
    per_seq = per_seq * sequence_tensors(seqs, width, CPU)["mask"]
    for packing in (False, True):
        back = torch.zeros_like(per_seq)
        for mb in micro_batches(seqs, 1, 0, CPU, packing=packing):
            rows = mb.from_sequences(per_seq)
            assert bool((rows[mb.labels == IGNORE] == 0).all())
            mb.to_sequences(rows, back)
        assert torch.equal(back, per_seq)
    empty = micro_batches([], 64, 0, CPU, packing=True)
    assert len(empty) == 1 and empty[0].weight == 0 and empty[0].seq_index == []
    with pytest.raises(ValueError, match="micro_token_budget"):
        micro_batches(seqs, 0, 0, CPU)


# ---------------------------------------------------------------- Liger-Kernel on the policy (model.liger)


@pytest.mark.parametrize("choice,device,installed,expect", [
    ("auto", "cpu", True, False), ("auto", "cuda", False, False), ("auto", "cuda", True, True),
    (False, "cuda", True, False), (True, "cuda", True, True), ("on", "cuda", True, True),
    (True, "cpu", True, "CUDA GPU"), (True, "cuda", False, "pip install 'fastcov\\[liger\\]'"),
])
def test_liger_decision(choice, device, installed, expect):
    from fastcov.trainer.runtime.model import use_liger

    if isinstance(expect, str):
        with pytest.raises(ValueError, match="model.liger: .*" + expect):
            use_liger(choice, torch.device(device), installed)
    else:
        assert use_liger(choice, torch.device(device), installed) is expect


def test_liger_on_a_cpu_run_is_a_one_line_error_before_anything_is_written(tmp_path):
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"trainer.run_dir={tmp_path / 'run'}", "model.liger=on",
                                                       "trainer.device=cpu"])
    with pytest.raises(Exception, match="model.liger: Liger-Kernel's Triton kernels need a CUDA GPU"):
        train_mod.train(cfg)
    assert not (tmp_path / "run").exists()


def test_gradient_checkpointing_is_enabled_without_deprecation_warnings():
    """model.gradient_checkpointing turns activation checkpointing on by the name the installed
    transformers takes (5.24 warns on gradient_checkpointing_enable), and the gradients stay the same."""
    import warnings

    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["model.attn_implementation=sdpa"])
    tok = load_tokenizer(cfg.model)
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    grads = []
    for on in (False, True):
        cfg.model.gradient_checkpointing = on
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lm = build_model(cfg.model, CPU, torch.float32, tok)
        assert lm.is_gradient_checkpointing == on
        assert not [w for w in caught if "checkpointing" in str(w.message)], [str(w.message) for w in caught]
        lm.train()
        lm(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


class _Engine:
    """What compute_old_logprobs needs of the DeepSpeed engine: ``policy``, ``eval()`` and the forward."""

    def __init__(self, policy):
        self.policy = policy

    def eval(self):
        self.policy.eval()

    def __call__(self, **kw):
        return self.policy(**kw)


def test_logprob_token_budget_splits_step_4_only(policy, monkeypatch):
    from fastcov.trainer import train as T
    from fastcov.trainer.config import ConfigError

    budgets = []
    real = T.micro_batches
    monkeypatch.setattr(T, "micro_batches", lambda *a, **k: budgets.append(k["budget"]) or real(*a, **k))
    engine = _Engine(policy)
    out = {}
    for over in ([], ["trainer.logprob_token_budget=40"]):
        cfg = load_config(ROOT / "configs" / "tiny.yaml", over)
        seqs = _sequences()
        for s in seqs:
            s.old_logprob = None
        T.compute_old_logprobs(engine, seqs, cfg, pad_id=0, device=CPU)
        out[len(over)] = seqs
        # the update's micro-batches keep trainer.micro_token_budget
        assert T.batching(cfg, engine)["budget"] == cfg.trainer.micro_token_budget
    assert budgets == [load_config(ROOT / "configs" / "tiny.yaml", []).trainer.micro_token_budget, 40]
    for a, b in zip(out[0], out[1], strict=True):
        assert a.old_logprob is not None and all(x < 0 for x in a.old_logprob)
        torch.testing.assert_close(torch.tensor(b.old_logprob), torch.tensor(a.old_logprob), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="trainer.logprob_token_budget"):
        load_config(ROOT / "configs" / "tiny.yaml", ["trainer.logprob_token_budget=0"])
