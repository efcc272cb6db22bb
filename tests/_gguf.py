"""A tiny model written as a GGUF file by the gguf package's own writer, in llama.cpp's layout (the tensor names,
llama's q/k row order, a byte-level BPE tokenizer with merges and a chat template): what the GGUF tests and the
trainer bench's model case load."""

import gguf
import numpy as np
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def tiny_hf_model(model_type: str, tied: bool, seed: int = 0):
    """A random Llama or Qwen2 whose vocabulary is a byte-level BPE's (256 bytes, a few merges, 3 specials):
    norms and biases random too, so a weight read into the wrong place shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    vocab = len(_byte_tokens()) + len(MERGES) + len(SPECIALS)
    config = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                                  tie_word_embeddings=tied, bos_token_id=None, eos_token_id=vocab - 1,
                                  pad_token_id=vocab - 3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return model


MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (its converter's permute; transformers' reader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, arch: str | None = None, quantize: dict | None = None) -> None:
    """``model``'s weights and the tiny tokenizer in llama.cpp's layout, written by the gguf package's writer.
    ``quantize``: {tensor name: GGMLQuantizationType} to store those tensors quantized by gguf's quantizer."""
    cfg = model.config
    arch = arch or ("llama" if cfg.model_type == "llama" else cfg.model_type)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens = _byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_pad_token_id(len(tokens) - 3)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for proj in "qkv":
        per_layer[f"self_attn.{proj}_proj.weight"] = f"attn_{proj}.weight"
        per_layer[f"self_attn.{proj}_proj.bias"] = f"attn_{proj}.bias"
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    for hf, gg in names.items():
        if hf not in sd:
            continue
        t = sd[hf]
        if arch == "llama" and ("attn_q." in gg or "attn_k." in gg):
            t = _permute(t, cfg.num_attention_heads if "attn_q." in gg else cfg.num_key_value_heads)
        qtype = (quantize or {}).get(gg)
        if qtype is not None:
            w.add_tensor(gg, gguf.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gg, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
