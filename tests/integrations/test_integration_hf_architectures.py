"""Every causal-LM architecture transformers ships: apply_fastcov is exact or refuses at patch time.

Each model is built tiny from its config class (no downloads): sizes shrunk, 2 layers, vocabulary 96, fp32,
eval mode. Then either ``apply_fastcov`` raises ``UnsupportedModelError`` naming the class (nothing runs), or the
patched forward's log-probs and entropies equal the model's own ``log_softmax(logits)`` (and its own
entropy) at fp32 precision. Architectures that cannot be built or run on CPU are skipped with the reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from fastcov.integrations.transformers import (  # noqa: E402
    EXACT_ARCHITECTURES,
    UnsupportedModelError,
    apply_fastcov,
)

CAUSAL_LM = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
VOCAB = 96
LAYERS = 2
# config keys set to a small value wherever a config (or one of its sub-configs) has them
SMALL = {
    "vocab_size": VOCAB, "text_vocab_size": VOCAB,
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "dim": 32, "n_embed": 32, "emb_dim": 32,
    "d_embed": 32, "embedding_size": 32, "word_embed_proj_dim": 32,
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS,
    "decoder_layers": LAYERS, "encoder_layers": LAYERS, "num_decoder_layers": LAYERS,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 8, "kv_channels": 8, "attention_head_size": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "qk_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 16,
    "intermediate_size": 64, "ffn_dim": 64, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64, "n_inner": 64,
    "ffn_hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "dense_intermediate_size": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2, "n_shared_experts": 1,
    "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 64, "n_positions": 64, "max_seq_len": 64,
    "sliding_window": 16, "attention_window": 16,
    "mamba_d_state": 8, "state_size": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1,
    "mamba_expand": 2, "ssm_state_size": 8, "time_step_rank": 4, "n_groups": 1, "mamba_headdim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "num_codebooks": 1, "rotary_dim": 4,
}
# per-architecture fixes where the generic shrink breaks a config invariant
FIXES = {
    "falcon_h1": {"mamba_d_ssm": None},
    "mamba2": {"head_dim": 16},
    "nemotron": {"num_key_value_heads": 2},
    "zamba2": {"attention_head_dim": 16},
    "reformer": {"is_decoder": True},
    "zaya": {"num_experts_per_tok": 1},
}
# ids that index the embedding: kept below the small vocabulary
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
             "cls_token_id", "mask_token_id", "unk_token_id")
# ids of special tokens that are not part of the text vocabulary (multimodal placeholders)
PLACEHOLDER_IDS = ("image_token_id", "image_token_index", "video_token_id", "audio_token_id", "boi_token_id",
                   "eoi_token_id", "boa_token_id", "eoa_token_id")
# Variants of default configs: the plain head of an architecture whose default turns a logit transform on
# must be exact; a transform turned on must be refused, naming the attribute.
EXACT_VARIANTS = {
    "gemma2-no-softcap": ("gemma2", {"final_logit_softcapping": None}),
    "vaultgemma-no-softcap": ("vaultgemma", {"final_logit_softcapping": None}),
    "nanochat-no-softcap": ("nanochat", {"final_logit_softcapping": None}),
    "beam-no-softcap": ("beam", {"final_logit_softcapping": None}),
    "cohere-scale-1": ("cohere", {"logit_scale": 1.0}),
    "cohere2-scale-1": ("cohere2", {"logit_scale": 1.0}),
    "inkling-mup-1": ("inkling_text", {"logits_mup_width_multiplier": 1.0}),
    "gpt2-untied": ("gpt2", {"tie_word_embeddings": False}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
}
REFUSED_VARIANTS = {
    "falcon_h1-multiplier-0.5": ("falcon_h1", {"lm_head_multiplier": 0.5}, "lm_head_multiplier"),
    "granite-scaling-2": ("granite", {"logits_scaling": 2.0}, "logits_scaling"),
    # a class whose forward does not cap: the attribute alone must not make fastcov cap (or pass unnoticed)
    "qwen2-softcap-attribute": ("qwen2", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    "gemma2-softcap-negative": ("gemma2", {"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    "cohere-scale": ("cohere", {"logit_scale": 0.0625}, "logit_scale"),
    "roberta-head-layers": ("roberta", {"is_decoder": True}, "lm_head.dense"),
    "modernbert-decoder": ("modernbert-decoder", {}, "get_decoder()"),
    "prophetnet-unlisted": ("prophetnet", {}, "EXACT_ARCHITECTURES"),
}
# Gemma 2's soft cap (final_logit_softcapping) on, at caps the tiny logits reach (the default 30 barely bends them)
# and at temperatures ≠ 1 (the cap comes first, as the model's sampling applies it): exact, with the kernel's cap
CAPPED_VARIANTS = {
    "gemma2-softcap-30": ("gemma2", {"final_logit_softcapping": 30.0}, 1.0),
    "gemma2-softcap-0.5-T0.7": ("gemma2", {"final_logit_softcapping": 0.5}, 0.7),
    "gemma3-softcap-0.5-T1.3": ("gemma3_text", {"final_logit_softcapping": 0.5}, 1.3),
    "vaultgemma-softcap-0.5": ("vaultgemma", {"final_logit_softcapping": 0.5}, 1.0),
    "nanochat-softcap-0.5": ("nanochat", {"final_logit_softcapping": 0.5}, 0.6),
    "beam-softcap-0.5": ("beam", {"final_logit_softcapping": 0.5}, 1.0),
}
# architectures whose tiny build takes long only to fail (kept out of the time budget)
SLOW_TO_FAIL = {"blt": "its byte-patch encoder keeps 2048-wide layers the generic shrink does not reach"}


def _small_kwargs(defaults: dict, extra: dict) -> dict:
    kwargs = {}
    old_layers = None
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if isinstance(defaults.get(key), int):
            old_layers = defaults[key]
            break
    for key, value in defaults.items():
        if key in SMALL and (isinstance(value, int) and not isinstance(value, bool)) and value > 0:
            kwargs[key] = SMALL[key]
        elif key in TOKEN_IDS or key in PLACEHOLDER_IDS:
            base = 3 + TOKEN_IDS.index(key) if key in TOKEN_IDS else VOCAB - 1 - PLACEHOLDER_IDS.index(key)
            if isinstance(value, int) and not isinstance(value, bool):
                kwargs[key] = base
            elif isinstance(value, list) and value:
                kwargs[key] = [base]
        elif isinstance(value, list) and old_layers and len(value) == old_layers and old_layers != LAYERS:
            kwargs[key] = value[:LAYERS]  # per-layer lists (layer_types, block patterns)
        elif isinstance(value, dict) and "model_type" in value:
            kwargs[key] = _small_kwargs(value, {})  # sub-configs (text_config, vision_config, ...)
    if "hidden_size" in kwargs and isinstance(defaults.get("hidden_size"), int) and "head_dim" in defaults:
        kwargs["head_dim"] = 8
    kwargs.update(extra)
    return kwargs


def _build(model_type: str, extra: dict):
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    kwargs = _small_kwargs(defaults, {**FIXES.get(model_type, {}), **extra})
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types"):
        if isinstance(defaults.get(key), list) and key not in kwargs and len(defaults[key]) > LAYERS:
            kwargs[key] = defaults[key][:LAYERS]
    config = config_class(**{k: v for k, v in kwargs.items() if k != "model_type"})
    model_class = getattr(transformers, CAUSAL_LM[model_type])
    attempts = [config]
    try:
        text_config = config.get_text_config()
    except ValueError:  # several text configs (music models): no text-only fallback
        text_config = config
    if text_config is not config:
        attempts.append(text_config)  # text-only class registered under a multimodal config
    for attempt in attempts:
        attempt._attn_implementation = "eager"
        try:
            torch.manual_seed(0)
            model = model_class(attempt).float().eval()
            input_ids, attention_mask = _inputs()
            with torch.no_grad():  # the model's own forward must run, or the architecture is skipped
                model._own_logits = model(input_ids=input_ids, attention_mask=attention_mask,
                                          use_cache=False).logits.float()
            return model
        except Exception as exc:  # noqa: BLE001 - the last attempt's error is the reason to skip
            error = exc
    raise error


def build_tiny(model_type: str, extra: dict | None = None):
    """A tiny fp32 eval-mode model of ``model_type``'s causal-LM class whose own forward runs; raises why not."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return _build(model_type, dict(extra or {}))
        except Exception:  # noqa: BLE001 - any config rejection: retried once with more key/value heads
            # multi-head latent attention and similar need as many key/value heads as query heads
            return _build(model_type, {"num_key_value_heads": 4, **(extra or {})})


def _inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(10, VOCAB - 10, (2, 7), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    return input_ids, attention_mask


def patch(model, **kwargs):
    """apply_fastcov(model) or the UnsupportedModelError it raised (at patch time: nothing has run)."""
    try:
        return apply_fastcov(model, impl="torch", **kwargs)
    except UnsupportedModelError as exc:
        return exc


def fused_vs_own(model, *, check: bool = True, temperature: float = 1.0):
    """max |fused − own| over the log-probs and entropies of every position (all labels valid), or the
    UnsupportedModelError apply_fastcov raised; check=False bypasses the allow-list (to find which are exact)."""
    input_ids, attention_mask = _inputs()
    with torch.no_grad():
        logits = getattr(model, "_own_logits", None)
        if logits is None:
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
        logp_all = torch.log_softmax(logits[:, :-1] / temperature, -1)
        own_logp = logp_all.gather(-1, input_ids[:, 1:, None])[..., 0]
        own_ent = -(logp_all.exp() * logp_all).sum(-1)
        patched = patch(model, temperature=temperature, allow_unlisted=not check)
        if isinstance(patched, UnsupportedModelError):
            return patched
        out = patched(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False)
    assert out.logits is None
    return max(float((out.logprob[:, 1:] - own_logp).abs().max()), float((out.entropy[:, 1:] - own_ent).abs().max()))


def _build_or_skip(model_type, extra=None):
    if model_type in SLOW_TO_FAIL:
        pytest.skip(f"{CAUSAL_LM[model_type]}: {SLOW_TO_FAIL[model_type]}")
    try:
        return build_tiny(model_type, extra)
    except Exception as exc:  # noqa: BLE001 - the build's error is the reason to skip
        pytest.skip(f"{CAUSAL_LM[model_type]} does not build tiny on CPU: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:160]}")


TOLERANCE = 1e-5  # fp32, vocabulary 96: the two paths differ by rounding only (observed ≤ 2e-6)


@pytest.mark.parametrize("model_type", sorted(CAUSAL_LM))
def test_architecture_is_exact_or_refused_at_patch_time(model_type):
    model = _build_or_skip(model_type)
    name = type(model).__name__
    result = fused_vs_own(model)
    if isinstance(result, UnsupportedModelError):
        assert name in str(result)
        return
    assert name in EXACT_ARCHITECTURES
    assert result < TOLERANCE, f"{name}: fused differs from the model's own log_softmax(logits) by {result:.3g}"


@pytest.mark.parametrize("variant", list(EXACT_VARIANTS))
def test_plain_head_variants_are_exact(variant):
    model_type, extra = EXACT_VARIANTS[variant]
    model = _build_or_skip(model_type, extra)
    result = fused_vs_own(model)
    assert not isinstance(result, UnsupportedModelError), str(result)
    assert result < TOLERANCE


@pytest.mark.parametrize("variant", list(CAPPED_VARIANTS))
def test_soft_capped_heads_are_exact(variant):
    from fastcov.integrations.transformers import SOFTCAP_ARCHITECTURES, logit_softcap

    model_type, extra, temperature = CAPPED_VARIANTS[variant]
    model = _build_or_skip(model_type, extra)
    assert type(model).__name__ in SOFTCAP_ARCHITECTURES and logit_softcap(model) == extra["final_logit_softcapping"]
    result = fused_vs_own(model, temperature=temperature)
    assert not isinstance(result, UnsupportedModelError), str(result)
    assert result < TOLERANCE
    if extra["final_logit_softcapping"] < 1:  # the cap changes these logits: uncapped they would be far off
        plain = build_tiny(model_type, {**extra, "final_logit_softcapping": None})
        plain.load_state_dict(model.state_dict())
        plain._own_logits = model._own_logits  # the capped model's logits against the uncapped fused path
        assert fused_vs_own(plain, temperature=temperature) > 100 * TOLERANCE


@pytest.mark.parametrize("variant", list(REFUSED_VARIANTS))
def test_logit_transforms_and_head_layers_are_refused_naming_class_and_attribute(variant):
    model_type, extra, attribute = REFUSED_VARIANTS[variant]
    model = _build_or_skip(model_type, extra)
    forward = model.forward
    result = patch(model)
    assert isinstance(result, UnsupportedModelError)
    assert type(model).__name__ in str(result) and attribute in str(result)
    assert "\n" not in str(result)
    assert model.forward == forward  # nothing patched


@pytest.mark.parametrize("model_type,temperature", [("qwen2", 0.7), ("gpt2", 1.3), ("phi", 0.6)])
def test_temperature_and_bias(model_type, temperature):
    model = _build_or_skip(model_type)
    if model_type == "phi":
        assert model.get_output_embeddings().bias is not None  # Phi's head has a bias
    result = fused_vs_own(model, temperature=temperature)
    assert not isinstance(result, UnsupportedModelError) and result < TOLERANCE


def test_float64_is_refused_at_patch_time():
    model = _build_or_skip("qwen2").double()
    result = patch(model)
    assert isinstance(result, UnsupportedModelError)
    assert "Qwen2ForCausalLM" in str(result) and "lm_head.weight" in str(result) and "float64" in str(result)


def test_allow_list_names_only_shipped_classes():
    assert EXACT_ARCHITECTURES <= set(CAUSAL_LM.values())


def test_unlisted_class_is_refused_because_plain_structure_is_not_enough():
    """ProphetNet passes every structural check (linear head held by the model, no transform in its config)
    but its logits come from its n-gram predicting stream: only the allow-list keeps it from being wrong."""
    model = _build_or_skip("prophetnet")
    assert isinstance(patch(model), UnsupportedModelError)
    assert fused_vs_own(model, check=False) > 0.01
