"""fastcov inside TRL's GRPOTrainer, on a tiny Qwen2 built from a config and a char-level tokenizer (CPU, offline;
both in tests/_trl_harness.py)."""

import importlib
import math
import sys

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from _trl_harness import VOCAB, reward_digits, tiny_model, tiny_tokenizer  # noqa: E402

from fastcov.integrations.trl import FastcovGRPOConfig, FastcovGRPOTrainer  # noqa: E402


def make_args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
        max_steps=1, logging_steps=1, learning_rate=1e-3, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, disable_tqdm=True, dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return FastcovGRPOConfig(**kwargs)


def tiny_gemma2(softcap, seed=0):
    """A tiny Gemma 2 (built offline from its config) whose head is soft-capped at ``softcap``."""
    torch.manual_seed(seed)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, final_logit_softcapping=softcap, sliding_window=16,
    )
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def make_trainer(tmp_path, n_prompts=2, model=None, **overrides):
    prompts = ["12+7=", "3*4=", "9-5=", "20/4=", "8+8=", "6*7="][:n_prompts]
    return FastcovGRPOTrainer(
        model=model if model is not None else tiny_model(), reward_funcs=reward_digits,
        args=make_args(tmp_path, **overrides),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), processing_class=tiny_tokenizer(),
    )


def padded_batch(seed=1, rows=5, prompt=6, completion=7):
    """[B, P + C] ids and mask with left-padded prompts and right-padded completions, like TRL's."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, prompt + completion), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(rows):
        mask[row, : row % 3] = 0  # left padding of the prompt
        mask[row, prompt + completion - (row % 4):] = 0  # right padding of the completion
    ids[mask == 0] = 0
    return ids, mask, completion


# ---------------------------------------------------------------- (1) parity with TRL's own log-probs


@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.0, 30.0), (0.7, 0.5)])
def test_fused_logps_and_entropies_match_trl(tmp_path, temperature, softcap):
    """Qwen2, and a Gemma 2 head soft-capped at its default 30 and at 0.5 (the cap bends these logits: the kernel
    must cap them, before the temperature, as the model's forward and TRL's division do)."""
    model = None if softcap is None else tiny_gemma2(softcap)
    trainer = make_trainer(tmp_path, temperature=temperature, model=model)
    model = trainer.model
    ids, mask, keep = padded_batch()
    gen = torch.Generator().manual_seed(2)
    g, e = torch.randn(ids.shape[0], keep, generator=gen), torch.randn(ids.shape[0], keep, generator=gen)

    def run(method):
        model.zero_grad()
        logps, ent, aux = method(trainer, model, ids, mask, keep, batch_size=2, compute_entropy=True)
        ((logps * g).sum() + (ent * e).sum()).backward()
        return logps.detach(), ent.detach(), aux, [p.grad.clone() for p in model.parameters()]

    head_calls = []
    hook = model.lm_head.register_forward_hook(lambda *a: head_calls.append(1))
    logps, ent, aux, grads = run(FastcovGRPOTrainer._get_per_token_logps_and_entropies)
    hook.remove()
    ref_logps, ref_ent, _, ref_grads = run(trl.GRPOTrainer._get_per_token_logps_and_entropies)

    assert not head_calls, "the fastcov path must not run lm_head (no full logits)"
    assert aux is None and logps.shape == ent.shape == (ids.shape[0], keep)
    valid = mask[:, -keep:].bool()
    assert torch.all(logps[~valid] == 0) and torch.all(ent[~valid] == 0)
    assert torch.all(logps[valid] < 0) and ref_logps[valid].abs().min() > 0
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_vanilla_loss_matches_trl_loss(tmp_path, loss_type):
    """fastcov's vanilla mode under TRL's loss_type → agg mapping gives TRL's own loss, KL term included."""
    trainer = make_trainer(tmp_path, fastcov_loss_mode="vanilla", loss_type=loss_type, epsilon=0.1,
                           epsilon_high=0.15, delta=1.5, max_completion_length=7)
    trainer.current_gradient_accumulation_steps = 2
    trainer.beta = 0.05  # TRL reads self.beta in its loss; the reference log-probs are given below
    ids, mask, keep = padded_batch(rows=4)
    mask[3, -keep:] = 0  # a masked-out (e.g. truncated) completion still counts in TRL's per-row means
    ids[mask == 0] = 0
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
    prompt_len = ids.shape[1] - keep
    inputs = {
        "prompt_ids": ids[:, :prompt_len], "prompt_mask": mask[:, :prompt_len],
        "completion_ids": ids[:, prompt_len:], "completion_mask": mask[:, prompt_len:],
        "advantages": torch.randn(4, generator=gen),
        "old_per_token_logps": logps + 0.4 * torch.randn(logps.shape, generator=gen),  # some ratios clip
        "ref_per_token_logps": logps + 0.1 * torch.randn(logps.shape, generator=gen),
        "num_items_in_batch": mask[:, prompt_len:].sum() * 2,
    }
    trainer.model.train()
    ours = FastcovGRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    theirs = trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert trainer._metrics["train"]["fastcov/clipfrac"][-1] > 0


# ---------------------------------------------------------------- (2) one training step


@pytest.mark.parametrize(
    "mode,scope,extra",
    [
        ("kl_cov", "microbatch", dict(kl_cov_ratio=0.5)),
        ("clip_cov", "microbatch", dict(clip_cov_ratio=0.5, clip_cov_lb=-1e3, clip_cov_ub=1e3, epsilon=1.0)),
        ("kl_cov", "global", dict(kl_cov_ratio=0.5, per_device_train_batch_size=2, gradient_accumulation_steps=2)),
    ],
)
def test_one_training_step(tmp_path, mode, scope, extra):
    trainer = make_trainer(tmp_path, fastcov_loss_mode=mode, fastcov_scope=scope, **extra)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(result.training_loss)
    changed = [not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters(), strict=True)]
    assert any(changed), "no parameter changed"
    logs = next(entry for entry in trainer.state.log_history if "fastcov/selected_frac" in entry)
    for name in ("fastcov/cov_mean", "fastcov/cov_max", "fastcov/clipfrac", "fastcov/ppo_kl", "entropy"):
        assert name in logs and math.isfinite(logs[name]), name
    assert 0 < logs["fastcov/selected_frac"] <= 0.5 + 1e-6
    assert logs["entropy"] > 0


def test_global_scope_selects_over_the_rollout_batch(tmp_path):
    """k = ⌊ratio · n⌋ over the whole rollout batch, not per micro-batch; the rows follow TRL's shuffle/split."""
    trainer = make_trainer(tmp_path, fastcov_loss_mode="kl_cov", fastcov_scope="global", kl_cov_ratio=0.3)
    ids, mask, keep = padded_batch(rows=6)
    prompt_len = ids.shape[1] - keep
    output = {
        "prompt_ids": ids[:, :prompt_len], "prompt_mask": mask[:, :prompt_len],
        "completion_ids": ids[:, prompt_len:], "completion_mask": mask[:, prompt_len:],
        "advantages": torch.linspace(-1, 1, 6),
    }
    selection = trainer._fastcov_rollout_selection(output)
    n_valid = int(mask[:, prompt_len:].sum())
    assert selection.high_entropy is None
    assert int(selection.cov.sum()) == max(1, math.floor(0.3 * n_valid))
    assert not selection.cov[mask[:, prompt_len:] == 0].any()
    # one micro-batch of 2 rows selects far fewer than the rollout-wide k would give it on its own
    part = trainer._fastcov_rollout_selection({k: v[:2] for k, v in output.items()})
    assert int(part.cov.sum()) == max(1, math.floor(0.3 * int(mask[:2, prompt_len:].sum())))

    # top_entropy_quantile → a rollout-wide high-entropy mask, from one extra no-grad forward
    trainer.args.top_entropy_quantile = 0.5
    trainer._fastcov_config = trainer.args.fastcov_loss_config()
    with_entropy = trainer._fastcov_rollout_selection(output)
    assert int(with_entropy.high_entropy.sum()) == math.floor(0.5 * n_valid)
    assert torch.equal(with_entropy.cov, selection.cov)


# ---------------------------------------------------------------- (3) refused options


@pytest.mark.parametrize(
    "overrides,option",
    [
        (dict(fastcov_loss_mode="kl-cov"), "fastcov_loss_mode"),
        (dict(fastcov_scope="world"), "fastcov_scope"),
        (dict(kl_cov_ratio=0.0), "kl_cov_ratio"),
        (dict(clip_cov_ratio=1.5), "clip_cov_ratio"),
        (dict(clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb"),
        (dict(kl_cov_coef=-1.0), "kl_cov_coef"),
        (dict(loss_type="not_a_loss"), "loss_type"),
        # CISPO / SAPO / VESPO / GSPO have no token clip for Clip-Cov to select inside (KL-Cov's penalty adds to them)
        (dict(loss_type="cispo", fastcov_loss_mode="clip_cov"), "fastcov_loss_mode"),
        (dict(loss_type="vespo", fastcov_loss_mode="clip_cov"), "fastcov_loss_mode"),
        (dict(importance_sampling_level="sequence", fastcov_loss_mode="clip_cov"), "fastcov_loss_mode"),
        (dict(use_adaptive_entropy=True, entropy_coef_delta=-0.1), "entropy_coef_delta"),
        (dict(use_adaptive_entropy=True, entropy_coef=2.0), "entropy_coef"),  # outside [min, max] = [0, 1]
        (dict(fastcov_entropy_control={"target": 1.0, "knob": "kl_cov_coef", "delta": 0.1}),
         "fastcov_entropy_control"),  # the default mode, auto, is clip_cov with TRL's default loss_type dapo
        (dict(loss_type="cispo", fastcov_entropy_control={"target": 1.0, "knob": "clip_cov_ratio", "delta": 0.1}),
         "fastcov_entropy_control"),  # ... and kl_cov with cispo
        (dict(fastcov_entropy_control={"target": 1.0, "delta": 0.1}, use_adaptive_entropy=True),
         "fastcov_entropy_control"),
        (dict(off_policy_mask_threshold=-0.5), "off_policy_mask_threshold"),
        (dict(epsilon=-0.1), "epsilon"),
        (dict(fastcov_loss_mode="kl_cov", delta=2.0), "delta"),  # kl_cov replaces PPO's token clip
        (dict(fastcov_loss_mode="vanilla", delta=1.1), "delta"),  # must exceed 1 + epsilon_high
        (dict(top_entropy_quantile=0.0), "top_entropy_quantile"),
        (dict(fastcov_scope="global", steps_per_generation=2), "fastcov_scope"),
        (dict(fastcov_scope="global", num_iterations=2), "fastcov_scope"),
    ],
)
def test_bad_config_names_the_option(tmp_path, overrides, option):
    with pytest.raises(ValueError, match=option):
        make_args(tmp_path, **overrides)


def test_good_config_maps_trl_options(tmp_path):
    args = make_args(tmp_path, fastcov_loss_mode="clip_cov", epsilon=0.2, epsilon_high=0.28, delta=3.0,
                     top_entropy_quantile=0.2, loss_type="dr_grpo", max_completion_length=6)
    config = args.fastcov_loss_config()
    assert (config.clip_low, config.clip_high, config.dual_clip_c) == (0.2, 0.28, 3.0)
    assert config.high_entropy_fraction == 0.2 and config.loss_scale_factor == 6.0


def test_trainer_refuses_a_plain_grpo_config(tmp_path):
    with pytest.raises(TypeError, match="args"):
        FastcovGRPOTrainer(
            model=tiny_model(), reward_funcs=reward_digits,
            args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=2,
                                per_device_train_batch_size=2),
            train_dataset=datasets.Dataset.from_dict({"prompt": ["1+1="]}), processing_class=tiny_tokenizer(),
        )


def test_missing_trl_gives_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "fastcov.integrations.trl")
    with pytest.raises(ImportError, match=r"pip install 'fastcov\[trl\]'"):
        importlib.import_module("fastcov.integrations.trl")


# ---------------------------------------------------------------- LoRA through TRL's peft_config

@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_peft_config_trains_only_the_adapters(tmp_path, beta):
    """With a ``peft_config`` the policy is TRL's PeftModel: fastcov's fused head runs under the adapters,
    only they move, and the KL reference (beta > 0) is the base with the adapters disabled, not a copy."""
    peft = pytest.importorskip("peft")
    prompts = ["12+7=", "3*4="]
    trainer = FastcovGRPOTrainer(
        model=tiny_model(), reward_funcs=reward_digits, args=make_args(tmp_path, beta=beta),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), processing_class=tiny_tokenizer(),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    assert trainer.ref_model is None  # TRL scores the reference with model.disable_adapter()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(result.training_loss)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all(".lora_" in n for n in changed), sorted(changed)[:3]
    assert any(n.endswith("lm_head.weight") for n in before)  # the frozen head is there, unchanged
    logs = next(entry for entry in trainer.state.log_history if "fastcov/ppo_kl" in entry)
    assert math.isfinite(logs["fastcov/ppo_kl"])
    if beta:
        assert math.isfinite(logs["kl"])


def test_the_fastcov_loss_options_are_lossconfigs_own_fields(tmp_path):
    """FastcovGRPOConfig's LossConfig options (clip_cov_ratio, ..., kl_cov_coef) take LossConfig's types and defaults
    (derived from it, not restated) and reach the loss unchanged; the knob table is the library's."""
    import dataclasses
    import typing

    from fastcov.integrations.trl import LOSS_OPTIONS
    from fastcov.losses import LossConfig

    fields = {f.name: f for f in dataclasses.fields(FastcovGRPOConfig)}
    hints, trl_hints = typing.get_type_hints(LossConfig), typing.get_type_hints(FastcovGRPOConfig)
    assert set(LOSS_OPTIONS) == {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef"}
    for name in LOSS_OPTIONS:
        assert fields[name].default == getattr(LossConfig(), name) and trl_hints[name] == hints[name], name
    values = {"clip_cov_ratio": 0.013, "clip_cov_lb": 0.7, "clip_cov_ub": 4.2, "kl_cov_ratio": 0.021, "kl_cov_coef": 0.9}
    loss = make_args(tmp_path, fastcov_loss_mode="kl_cov", **values).fastcov_loss_config()
    assert {k: getattr(loss, k) for k in values} == values
    with pytest.raises(ValueError, match=r"knob clip_cov_ratio acts only with fastcov_loss_mode='clip_cov'"):
        make_args(tmp_path, fastcov_loss_mode="kl_cov",
                  fastcov_entropy_control={"target": 0.3, "knob": "clip_cov_ratio", "delta": 1e-4})
