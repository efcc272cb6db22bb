"""apply_fastcov on tiny Hugging Face models built from configs, against their own logits in float64."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from fastcov.integrations.transformers import apply_fastcov, revert_fastcov  # noqa: E402

SMALL = dict(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def tiny(kind, **extra):
    configs = {
        "qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
    }
    torch.manual_seed(0)
    config = configs[kind](**SMALL, **extra)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_patched_forward_matches_model_logits(kind, temperature):
    model = tiny(kind)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 211, (3, 9), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[1, :4] = -100  # a prompt
    g = torch.randn(3, 9, generator=gen, dtype=torch.float64)
    e = torch.randn(3, 9, generator=gen, dtype=torch.float64)

    logits = model(input_ids, attention_mask=attention_mask).logits.double() / temperature
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    targets = labels[:, 1:]
    valid = targets != -100
    ref_logp = torch.where(valid, logp_all.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0)
    ref_ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    ((ref_logp * g[:, 1:]).sum() + (ref_ent * e[:, 1:]).sum()).backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    apply_fastcov(model, temperature=temperature, impl="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is None and out.logprob.shape == (3, 9)
    assert torch.all(out.logprob[:, 0] == 0)
    torch.testing.assert_close(out.logprob[:, 1:].double(), ref_logp, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.entropy[:, 1:].double(), ref_ent, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.loss.double(), -ref_logp.sum() / valid.sum(), atol=1e-5, rtol=1e-5)
    ((out.logprob * g).sum() + (out.entropy * e).sum()).backward()
    for p, ref in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, ref, atol=1e-5, rtol=1e-3)

    # without labels the model is untouched: logits and generation still work
    assert model(input_ids).logits.shape == (3, 9, 211)
    revert_fastcov(model)
    assert model(input_ids, labels=labels).logits is not None


def test_refuses_models_it_cannot_fuse():
    model = tiny("qwen2")
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(32, 211))
    with pytest.raises(ValueError, match="Qwen2ForCausalLM.*lm_head.*plain torch.nn.Linear"):
        apply_fastcov(model)
    model = tiny("qwen2")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        apply_fastcov(model)


def test_missing_framework_is_a_clear_error(monkeypatch):
    from fastcov.integrations._require import require

    with pytest.raises(ImportError, match="pip install fastcov-nonexistent"):
        require("fastcov_nonexistent_framework", "nothing", "fastcov-nonexistent")
