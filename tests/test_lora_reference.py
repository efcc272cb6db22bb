"""LoRA policies with a reference model: REINFORCE++'s KL term and PRIME read the policy itself with its
adapters switched off (the frozen base, no second copy); PRIME's reward model trains adapters of its own."""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from fastcov.trainer import train as train_mod  # noqa: E402
from fastcov.trainer.config import load_config  # noqa: E402
from fastcov.trainer.runtime.run_dir import read_metrics  # noqa: E402
from fastcov.trainer.token_level import advantages as adv_mod  # noqa: E402
from fastcov.trainer.token_level.prime import AdaptersOffReference, FrozenModel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
LORA = ["model.lora_rank=4", "model.lora_alpha=8"]
QLORA = [*LORA, "model.quantization=4bit", "model.arch.hidden_size=64", "model.arch.intermediate_size=128"]
KL = ["algo.adv_estimator=reinforce_pp", "algo.kl_coef=0.5", "algo.mode=vanilla"]
PRIME = ["algo.adv_estimator=prime", "algo.mode=vanilla", "algo.prime.lr=1e-2", "algo.prime.acc_low=0.0",
         "algo.prime.acc_high=1.0"]


@pytest.fixture(autouse=True)
def varied_rewards(monkeypatch):
    monkeypatch.setattr(train_mod.RewardFn, "__call__", lambda self, text, truth: float(len(text) % 2))


def tiny(tmp_path, name, *overrides):
    return load_config(TINY, [f"trainer.run_dir={tmp_path / name}", "reward.sandbox=inline", "trainer.eval_every=0",
                              "trainer.device=cpu", "optim.lr=1e-2", *overrides])


def _capture(monkeypatch):
    """The run's TokenAdvantages and the arguments of its last ``apply``."""
    seen: dict = {}
    real_make, real_apply = adv_mod.make_token_advantages, adv_mod.TokenAdvantages.apply

    def make(cfg, lm):
        seen["token_adv"] = real_make(cfg, lm)
        return seen["token_adv"]

    def apply(self, seqs, *args):
        seen["apply_args"] = (seqs, *args)
        return real_apply(self, seqs, *args)

    monkeypatch.setattr(train_mod, "make_token_advantages", make)
    monkeypatch.setattr(adv_mod.TokenAdvantages, "apply", apply)
    return seen


@pytest.mark.slow
def test_kl_reference_is_the_policy_with_adapters_off(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    checks = {}

    def on_end(engine, rollout):
        ref = seen["token_adv"].ref
        checks["no_copy"] = isinstance(ref, AdaptersOffReference) and ref.engine is engine
        seqs, pad_id, device, batch_kw = seen["apply_args"]
        got = ref.logprobs(seqs, pad_id, device, batch_kw, 1.0)
        # the base by other means: a copy of the trained policy whose adapters' B matrices are zeroed
        base = FrozenModel(engine.policy.lm)
        with torch.no_grad():
            for name, p in base.model.lm.named_parameters():
                if ".lora_B." in name:
                    p.zero_()
        checks["want"] = base.logprobs(seqs, pad_id, device, batch_kw, 1.0)
        checks["got"] = got
        checks["policy"] = FrozenModel(engine.policy.lm).logprobs(seqs, pad_id, device, batch_kw, 1.0)
        checks["adapters_on_after"] = all(p.requires_grad for n, p in engine.policy.lm.named_parameters()
                                          if ".lora_" in n)

    run = train_mod.train(tiny(tmp_path, "kl", *LORA, *KL, "trainer.max_steps=2"), on_end=on_end)
    recs = read_metrics(run / "metrics.jsonl")
    assert recs[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # step 1: B = 0, the policy is its base
    assert abs(recs[1]["kl_ref"]) > 1e-4  # step 2: the adapters moved it
    assert checks["no_copy"] and checks["adapters_on_after"]
    flat = lambda rows: torch.tensor([x for r in rows for x in r], dtype=torch.float64)  # noqa: E731
    torch.testing.assert_close(flat(checks["got"]), flat(checks["want"]), rtol=0, atol=1e-6)
    assert (flat(checks["policy"]) - flat(checks["want"])).abs().max() > 1e-4  # the adapters do act


@pytest.mark.slow
def test_kl_reference_under_zero3_gathers_the_policys_own_weights(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    run = train_mod.train(tiny(tmp_path, "z3", *LORA, *KL, "trainer.zero_stage=3", "trainer.max_steps=2"))
    recs = read_metrics(run / "metrics.jsonl")
    assert isinstance(seen["token_adv"].ref, AdaptersOffReference)
    assert recs[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and abs(recs[1]["kl_ref"]) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["none", "4bit"])
def test_prime_with_lora_trains_only_adapters_and_resumes(tmp_path, monkeypatch, quant):
    seen = _capture(monkeypatch)
    over = [*(QLORA if quant == "4bit" else LORA), *PRIME, "trainer.max_steps=2", "trainer.save_every=1"]
    run = train_mod.train(tiny(tmp_path, "full", *over))
    ta = seen["token_adv"]
    assert isinstance(ta.ref, AdaptersOffReference)
    prm_lm = ta.prm.model.lm
    trainable = {n for n, p in prm_lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    recs = read_metrics(run / "metrics.jsonl")
    assert recs[-1]["process_reward_mean"] != 0  # the PRM's adapters moved it away from the base
    assert (run / "checkpoints" / "step_000002" / "prm.pt").is_file()
    cut = tiny(tmp_path, "cut", *over)
    train_mod.train(cut, stop_at=1)
    train_mod.train(cut, resume=True)

    def strip(rs):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))} for r in rs]

    assert strip(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == strip(recs)
