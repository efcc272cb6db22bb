"""PRIME: implicit process rewards (token rewards, returns, the CE-trained PRM) and a tiny CPU run."""

import pytest
import torch

from fastcov import token_advantages as ta


def rand_batch(B=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return mask, torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)


def test_prime_returns_match_the_formula():
    n = 3
    mask, proc, _ = rand_batch(6, 5)
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    got = ta.prime_returns(outcome, proc, mask, n, outcome_coef=0.7, process_coef=1.3)
    for i in range(6):
        g0 = (i // n) * n
        others = [j for j in range(g0, g0 + n) if j != i]
        L = int(mask[i].sum())
        base = sum(float(proc[j][mask[j]].mean()) for j in others) / (n - 1)
        o_adv = float(outcome[i]) - sum(float(outcome[j]) for j in others) / (n - 1)
        for t in range(5):
            if t >= L:
                assert got[i, t] == 0
                continue
            want = 1.3 * sum(float(proc[i, s]) - base for s in range(t, L)) + 0.7 * o_adv
            assert float(got[i, t]) == pytest.approx(want, abs=1e-5)


def test_whiten_over_ranks_equals_whole_batch():
    mask, x, _ = rand_batch(8, 6, seed=1)
    whole = ta.whiten(x, mask)
    v = whole[mask]
    assert float(v.mean()) == pytest.approx(0.0, abs=1e-6) and float(v.std()) == pytest.approx(1.0, abs=1e-5)
    stats = ta.whiten_stats(x[:3], mask[:3]) + ta.whiten_stats(x[3:], mask[3:])  # two "ranks"
    parts = torch.cat([ta.whiten(x[:3], mask[:3], stats), ta.whiten(x[3:], mask[3:], stats)])
    assert torch.allclose(parts, whole, atol=1e-6)
    assert (whole[~mask] == 0).all()


def test_ce_loss_pushes_scores_toward_the_labels():
    mask, rm, ref = rand_batch(4, 5, seed=2)
    rm = rm.clone().requires_grad_(True)
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    loss, score = ta.prime_ce_loss(rm, ref, mask, labels, beta=0.05)
    want = torch.nn.functional.binary_cross_entropy_with_logits(0.05 * ((rm.detach() - ref) * mask).sum(-1), labels)
    assert float(loss.detach()) == pytest.approx(float(want))
    loss.backward()
    # correct responses: raise log pi_rm on their tokens (negative gradient); wrong: lower it
    assert (rm.grad[0][mask[0]] < 0).all() and (rm.grad[1][mask[1]] > 0).all()
    assert (rm.grad[~mask] == 0).all()


def test_implicit_prm_learns_to_separate_outcomes():
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.batch import Sequence
    from fastcov.trainer.runtime.model import build_model, load_tokenizer
    from fastcov.trainer.token_level.prime import FrozenModel, ImplicitPRM

    cfg = load_config("configs/tiny.yaml")
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model)
    lm = build_model(cfg.model, torch.device("cpu"), torch.float32, tok)
    prm = ImplicitPRM(lm, beta=0.05, lr=3e-2)
    ref = FrozenModel(lm)  # the starting weights
    g = torch.Generator().manual_seed(0)
    seqs, labels = [], []
    for i in range(16):  # correct answers end in token 7, wrong ones in token 9
        resp = torch.randint(10, 40, (4,), generator=g).tolist() + [7 if i % 2 == 0 else 9]
        seqs.append(Sequence([1, 2, 3], resp, [0.0] * 5, i))
        labels.append(1.0 if i % 2 == 0 else 0.0)
    kw = {"budget": 512, "packing": True, "row_capacity": None}
    dev = torch.device("cpu")
    ref_lp = ref.logprobs(seqs, 0, dev, kw, 1.0)
    first = prm.update(seqs, labels, ref_lp, 0, dev, kw, 1.0)
    assert first["prm_loss"] == pytest.approx(0.6931, abs=1e-3)  # π_rm = π_ref: score 0
    for _ in range(15):
        last = prm.update(seqs, labels, ref_lp, 0, dev, kw, 1.0)
    assert last["prm_loss"] < 0.6 and last["prm_acc"] == 1.0
    rm_lp = prm.logprobs(seqs, 0, dev, kw, 1.0)
    final_reward = [0.05 * (rm_lp[i][-1] - ref_lp[i][-1]) for i in range(16)]
    assert min(final_reward[0::2]) > max(final_reward[1::2])  # the deciding token gets the credit


def test_prime_tiny_run_and_resume(tmp_path, varied_rewards):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.run_dir import read_metrics

    def cfg(name):
        return load_config("configs/tiny.yaml", [
            f"trainer.run_dir={tmp_path / name}", "reward.sandbox=inline", "algo.adv_estimator=prime",
            "algo.mode=vanilla", "trainer.max_steps=2", "trainer.save_every=1", "trainer.eval_every=0",
            "algo.prime.lr=1e-2", "algo.prime.acc_low=0.0", "algo.prime.acc_high=1.0"])

    full = train_mod.train(cfg("full"))
    recs = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert {"prm_loss", "prm_acc", "process_reward_mean"} <= set(r)
    assert recs[-1]["process_reward_mean"] != 0  # the PRM moved away from the reference
    assert (full / "checkpoints" / "step_000002" / "prm.pt").is_file()
    cut = cfg("cut")
    train_mod.train(cut, stop_at=1)
    train_mod.train(cut, resume=True)
    def strip(rs):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))} for r in rs]

    assert strip(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == strip(recs)
