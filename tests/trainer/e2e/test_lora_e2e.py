"""LoRA and QLoRA policies (model.lora_rank, model.quantization: 4bit) trained on CPU: only the adapters train (under
ZeRO 1, 2 and 3 too), are checkpointed and resumed bit-exactly; the HF engine samples from the adapted model itself;
a LoRA run's final/ is evaluated as its merged base; the reference of REINFORCE++'s KL and PRIME is the base with
the adapters switched off (the settings' checks, the adapters themselves, activation offload:
tests/trainer/runtime/test_lora.py)."""

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from _fixtures import LORA, stable, tiny_on_cpu

from fastcov.trainer import start as start_mod
from fastcov.trainer import train as train_mod
from fastcov.trainer.runtime.run_dir import read_metrics
from fastcov.trainer.token_level import advantages as adv_mod
from fastcov.trainer.token_level.prime import AdaptersOffReference, FrozenModel

# NF4 packs 64 inputs per block (bitsandbytes' CPU kernel also 32 outputs): a tiny model just wide enough
QLORA = [*LORA, "model.quantization=4bit", "model.arch.hidden_size=64", "model.arch.intermediate_size=128"]

pytestmark = pytest.mark.usefixtures("varied_rewards")  # tests/trainer/conftest.py


def _snapshot(monkeypatch):
    """Every tensor of the model right after it is built (before any step), by name."""
    built = {}
    real = start_mod.build_model

    def spy(*args, **kwargs):
        lm = real(*args, **kwargs)
        built.update({n: p.detach().clone() for n, p in lm.named_parameters()})
        return lm

    monkeypatch.setattr(start_mod, "build_model", spy)
    return built


def _train_and_compare(tmp_path, monkeypatch, name, *over):
    initial = _snapshot(monkeypatch)
    seen = {}

    def on_end(engine, rollout):
        lm = engine.policy.lm
        seen["same_module"] = rollout.model is lm  # the HF engine samples from the adapted policy itself
        seen["params"] = {n: p.detach().clone() for n, p in lm.named_parameters()}
        seen["trainable"] = {n for n, p in lm.named_parameters() if p.requires_grad}

    run = train_mod.train(tiny_on_cpu(tmp_path, name, "trainer.max_steps=2", *LORA, *over), on_end=on_end)
    changed = {n for n, p in seen["params"].items() if not torch.equal(p, initial[n])}
    return run, seen, changed


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["none", "4bit"])
def test_only_adapters_train_and_the_engine_samples_from_them(tmp_path, monkeypatch, quant):
    run, seen, changed = _train_and_compare(tmp_path, monkeypatch, "run", *(QLORA if quant == "4bit" else []))
    params = seen["params"]
    assert seen["trainable"] and all(".lora_" in n for n in seen["trainable"])
    assert changed and changed <= seen["trainable"]  # base, norms, embeddings and lm_head unchanged
    assert "lm_head.weight" in params and "lm_head.weight" not in changed
    if quant == "4bit":
        assert any(p.dtype == torch.uint8 for p in params.values())  # NF4-packed base weights
    assert seen["same_module"]
    recs = read_metrics(run / "metrics.jsonl")
    # the rollout log-probs are the adapted policy's own (the engine samples from the same module)
    assert abs(recs[-1]["rollout_logprob_diff"]) < 1e-4
    n_adapter_bytes = sum(p.numel() * p.element_size() for n, p in params.items() if n in seen["trainable"])
    assert recs[-1]["sync_bytes"] == n_adapter_bytes  # adapters only after the first sync
    final = run / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()


@pytest.mark.slow
def test_checkpoint_holds_only_adapters_and_resume_is_bit_exact(tmp_path):
    over = [*QLORA, "trainer.max_steps=3", "trainer.save_every=1"]
    full = train_mod.train(tiny_on_cpu(tmp_path, "full", *over))
    cut = tiny_on_cpu(tmp_path, "cut", *over)
    train_mod.train(cut, stop_at=1)
    state = torch.load(tmp_path / "cut" / "checkpoints" / "step_000001" / "ds" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)
    tensors = [k for k, v in state["module"].items() if torch.is_tensor(v) and v.dtype != torch.uint8]
    weights = [k for k in tensors if k.endswith(".weight") and ".lora_" not in k]
    assert not weights, f"frozen weights in the checkpoint: {weights[:3]}"
    train_mod.train(cut, resume=True)
    a, b = stable(read_metrics(full / "metrics.jsonl")), stable(read_metrics(tmp_path / "cut" / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3] and a == b
    from safetensors.torch import load_file

    fa, fb = load_file(full / "final" / "adapter_model.safetensors"), load_file(tmp_path / "cut" / "final" /
                                                                                "adapter_model.safetensors")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


# ---------------------------------------------------------------------------------------- ZeRO stages

@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_lora_under_zero_1_and_2_with_checkpointing_trains_only_adapters(tmp_path, monkeypatch, stage):
    run, seen, changed = _train_and_compare(tmp_path, monkeypatch, "run", f"trainer.zero_stage={stage}",
                                            "model.gradient_checkpointing=true")
    assert changed and changed <= seen["trainable"] and all(".lora_" in n for n in changed)
    assert read_metrics(run / "metrics.jsonl")[-1]["grad_norm"] > 0


@pytest.mark.slow
def test_lora_under_zero3_syncs_adapters_into_the_rollout_copy(tmp_path):
    """ZeRO-3 (one process): the HF engine samples from its own copy, built with the same adapter modules;
    the first sync sends everything, later ones the adapters only, and the copy's log-probs stay the policy's."""
    seen = {}

    def on_end(engine, rollout):
        seen["copy"] = rollout.model is not engine.policy.lm
        seen["adapter_bytes"] = sum(p.ds_numel * p.element_size() for n, p in engine.policy.lm.named_parameters()
                                    if p.requires_grad)

    run = train_mod.train(tiny_on_cpu(tmp_path, "z3", *LORA, "trainer.zero_stage=3", "trainer.max_steps=2"), on_end=on_end)
    recs = read_metrics(run / "metrics.jsonl")
    assert seen["copy"] and recs[-1]["grad_norm"] > 0
    assert recs[-1]["sync_bytes"] == seen["adapter_bytes"]
    assert all(abs(r["rollout_logprob_diff"]) < 1e-4 for r in recs)  # step 2 samples from the synced adapters
    assert (run / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_adapter_final_is_evaluated_as_its_merged_base(tmp_path, monkeypatch, capsys):
    """A LoRA run's final/ (an adapter naming its base by absolute path) is what `fastcov eval` and the demo's
    harder-split evaluation load: the base with the adapter merged, the trained policy's own outputs."""
    import json

    from fastcov.cli import main
    from fastcov.trainer.runtime.lora import is_adapter_dir, load_merged_adapter

    base = train_mod.train(tiny_on_cpu(tmp_path, "base", "trainer.max_steps=1")) / "final"
    seen = {}
    x = torch.randint(0, 40, (2, 9))

    def on_end(engine, rollout):
        with torch.no_grad():
            seen["logits"] = engine.policy.lm(x).logits

    run = train_mod.train(tiny_on_cpu(tmp_path, "lora", *LORA, f"model.path={base}", "model.arch=null", "optim.lr=1e-2",
                               "trainer.max_steps=2"), on_end=on_end)
    final = run / "final"
    assert is_adapter_dir(final)
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    monkeypatch.chdir(tmp_path)  # the base is found from any working directory
    merged = load_merged_adapter(final, torch.device("cpu"), torch.float32)
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, seen["logits"], rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert main(["eval", "--model", str(final), "--data", str(run / "data" / "val.parquet"), "--k", "2",
                 "--sample-all", "--max-new-tokens", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompts"] > 0
    (final / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(ValueError, match="cannot load its base model"):
        load_merged_adapter(final, torch.device("cpu"), torch.float32)


# ------------------------------------------------------------------ reference models: adapters off, no copy
# REINFORCE++'s KL term and PRIME read the policy itself with its adapters switched off (the frozen base, no
# second copy); PRIME's reward model trains adapters of its own.

FAST = ["optim.lr=1e-2"]
KL = ["algo.adv_estimator=reinforce_pp", "algo.kl_coef=0.5", "algo.mode=vanilla"]
PRIME = ["algo.adv_estimator=prime", "algo.mode=vanilla", "algo.prime.lr=1e-2", "algo.prime.acc_low=0.0",
         "algo.prime.acc_high=1.0"]


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

    monkeypatch.setattr(start_mod, "make_token_advantages", make)
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

    run = train_mod.train(tiny_on_cpu(tmp_path, "kl", *LORA, *KL, *FAST, "trainer.max_steps=2"), on_end=on_end)
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
    run = train_mod.train(tiny_on_cpu(tmp_path, "z3", *LORA, *KL, *FAST, "trainer.zero_stage=3", "trainer.max_steps=2"))
    recs = read_metrics(run / "metrics.jsonl")
    assert isinstance(seen["token_adv"].ref, AdaptersOffReference)
    assert recs[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and abs(recs[1]["kl_ref"]) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["none", "4bit"])
def test_prime_with_lora_trains_only_adapters_and_resumes(tmp_path, monkeypatch, quant):
    seen = _capture(monkeypatch)
    over = [*(QLORA if quant == "4bit" else LORA), *PRIME, *FAST, "trainer.max_steps=2", "trainer.save_every=1"]
    run = train_mod.train(tiny_on_cpu(tmp_path, "full", *over))
    ta = seen["token_adv"]
    assert isinstance(ta.ref, AdaptersOffReference)
    prm_lm = ta.prm.model.lm
    trainable = {n for n, p in prm_lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    recs = read_metrics(run / "metrics.jsonl")
    assert recs[-1]["process_reward_mean"] != 0  # the PRM's adapters moved it away from the base
    assert (run / "checkpoints" / "step_000002" / "prm.pt").is_file()
    cut = tiny_on_cpu(tmp_path, "cut", *over)
    train_mod.train(cut, stop_at=1)
    train_mod.train(cut, resume=True)

    def strip(rs):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))} for r in rs]

    assert strip(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == strip(recs)
