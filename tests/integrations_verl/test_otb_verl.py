"""Optimal Token Baseline against verl 0.9.1's own code (runs in .venv-verl: ``make test-verl``).

1. ``fastcov.token_advantages.optimal_token_baseline`` equals verl's ``compute_optimal_token_baseline_advantage``
   on random batches (ragged lengths, unordered prompt groups, a group of one, rollout IS weights, the zero tail).
2. With ``fastcov.integrations.verl.enable_fused_head()``, verl's FSDP engine runs its fused path
   (``use_fused_kernels=true``, which verl refuses for ``calculate_sum_pi_squared``) on fastcov's kernel: its
   ``prepare_model_inputs`` / model forward / ``prepare_model_outputs`` give the log-probs, entropies and Σπ² that
   verl's own unfused path gives from the model's logits (a tiny Qwen2, and a Gemma 2 whose head is soft-capped),
   and OTB built from the fused outputs equals verl's OTB built from its own.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
transformers = pytest.importorskip("transformers")

from fastcov import token_advantages as ta  # noqa: E402


def _batch(seed, B=10, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 3
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randn(B, generator=g)
    logp = -torch.rand(B, T, generator=g) * 3
    p2 = torch.rand(B, T, generator=g) * 0.6 + 0.02
    weights = torch.rand(B, T, generator=g) + 0.5
    uids = np.array(["b", "b", "a", "b", "c", "a", "a", "d", "c", "b"][:B], dtype=object)  # "d": a group of one
    return rewards, mask, uids, logp, p2, weights


def _group_ids(uids) -> torch.Tensor:
    return torch.from_numpy(np.unique(uids, return_inverse=True)[1]).long()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_otb_equals_verls_own(seed, with_weights, zero_tail):
    rewards, mask, uids, logp, p2, weights = _batch(seed)
    w = weights if with_weights else None
    want_adv, want_ret = core_algos.compute_optimal_token_baseline_advantage(
        rewards, mask, uids, logp, p2, rollout_is_weights=w, handle_zero_tail=zero_tail)
    adv, ret = ta.optimal_token_baseline(rewards, mask, _group_ids(uids), logp, p2, w, handle_zero_tail=zero_tail)
    # verl sums in fp32, fastcov in float64: a few fp32 ulps of values near 1
    torch.testing.assert_close(adv, want_adv, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ret, want_ret, atol=2e-6, rtol=1e-5)


# ---------------------------------------------------------------- verl's engine, fused path on


def _tiny(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if kind == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.8, sliding_window=16)
        config._attn_implementation = "eager"
    else:
        config = transformers.Qwen2Config(**common)
        config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _engine():
    """What FSDPEngineWithLMHead's prepare_model_inputs/outputs read of their engine, on one process."""
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead

    stub = types.SimpleNamespace(
        use_ulysses_sp=False, pad_to_length=False, pad_to_length_bucket=None,
        engine_config=types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                            entropy_from_logits_chunk_size=2048),
        compute_entropy_from_logits=verl_F.entropy_from_logits,
    )
    for name in ("_get_packed_pad_size", "_gather_and_unpad_packed"):
        setattr(stub, name, types.MethodType(getattr(FSDPEngine, name), stub))
    for name in ("prepare_model_inputs", "prepare_model_outputs"):
        setattr(stub, name, types.MethodType(getattr(FSDPEngineWithLMHead, name), stub))
    return stub


def _micro_batch(lengths, fused: bool, temperature: float, use_remove_padding: bool):
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 61, (n,), generator=g) for n in lengths]
    return tu.get_tensordict(
        {"input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
         "position_ids": torch.nested.nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)},
        non_tensor_dict={"use_remove_padding": use_remove_padding, "pad_mode": DatasetPadMode.NO_PADDING,
                         "use_fused_kernels": fused, "calculate_entropy": True, "calculate_sum_pi_squared": True,
                         "temperature": temperature})


def _run(model, engine, lengths, fused, temperature, use_remove_padding):
    micro_batch = _micro_batch(lengths, fused, temperature, use_remove_padding)
    inputs, output_args = engine.prepare_model_inputs(micro_batch)
    with torch.no_grad():  # the engine's forward_step calls its module so
        output = model(**inputs, use_cache=False)
        out = engine.prepare_model_outputs(output, output_args, micro_batch, None)
    return {k: torch.cat(list(out[k].unbind())) for k in ("log_probs", "entropy", "sum_pi_squared")}


@pytest.mark.parametrize("kind,temperature", [("qwen2", 1.0), ("qwen2", 0.7), ("gemma2", 0.6)])
@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_fused_path_gives_verls_sum_pi_squared_and_otb(kind, temperature, use_remove_padding):
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    from fastcov.integrations import verl as fastcov_verl

    fastcov_verl.enable_fused_head()
    engine = _engine()
    lengths = [5, 9, 3, 9, 6, 2]
    unfused_model = _tiny(kind)
    plain = _run(unfused_model, engine, lengths, False, temperature, use_remove_padding)
    fused_model = _tiny(kind)
    own_forward = type(fused_model).forward  # verl patches the class: restored for the other tests
    patch_forward_with_backends(fused_model, use_fused_kernels=True, fused_kernels_backend="triton")
    try:
        assert type(fused_model).forward is fastcov_verl.fused_forward
        fused = _run(fused_model, engine, lengths, True, temperature, use_remove_padding)
    finally:
        type(fused_model).forward = own_forward
    # both from the same hidden states: verl's fp32 log_softmax on the logits against the kernel's streaming sums.
    # A sequence's last position predicts no token of it (verl's unfused path labels it with the next sequence's
    # first token, its fused path without remove_padding with padding; nothing reads it): left out of the log-probs
    last = torch.tensor(lengths).cumsum(0) - 1
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[last] = False
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        got, want = (fused[name], plain[name]) if name != "log_probs" else (fused[name][keep], plain[name][keep])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")

    # OTB on the two: every sequence's response is its tokens after the first (lengths - 1 positions)
    width = max(lengths)
    def per_seq(flat):
        out, at = torch.zeros(len(lengths), width), 0
        for i, n in enumerate(lengths):
            out[i, :n] = flat[at:at + n]
            at += n
        return out
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None] - 1).float()
    rewards = torch.zeros(len(lengths), width)
    rewards[torch.arange(len(lengths)), torch.tensor(lengths) - 2] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    uids = np.array(["p", "q", "p", "q", "p", "q"], dtype=object)
    want, _ = core_algos.compute_optimal_token_baseline_advantage(
        rewards, mask, uids, per_seq(plain["log_probs"]), per_seq(plain["sum_pi_squared"]))
    got, _ = ta.optimal_token_baseline(rewards, mask, _group_ids(uids), per_seq(fused["log_probs"]),
                                       per_seq(fused["sum_pi_squared"]))
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_fused_sum_pi_squared_without_fastcovs_forward_says_what_to_do():
    from fastcov.integrations import verl as fastcov_verl

    fastcov_verl.enable_fused_head()
    engine = _engine()
    micro_batch = _micro_batch([4, 3], True, 1.0, True)
    _, output_args = engine.prepare_model_inputs(micro_batch)
    verl_output = types.SimpleNamespace(log_probs=torch.zeros(1, 7), entropy=torch.zeros(1, 7))
    with pytest.raises(NotImplementedError, match="enable_fused_head"):
        engine.prepare_model_outputs(verl_output, output_args, micro_batch, None)
