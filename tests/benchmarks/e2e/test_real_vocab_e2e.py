"""bench/real_vocab.py's prepare end to end: from the warm start, the rebuilt model at Qwen2.5's full vocabulary (the
warm start's logits kept on the demo's tokens, the head tied), written once and reused (the tokenizer and the filler
rows: tests/benchmarks/test_real_vocab.py)."""

import json

import pytest
import torch

from bench import real_vocab as R


@pytest.mark.slow
def test_prepare_builds_the_full_vocabulary_from_the_warm_start(tmp_path):
    from transformers import AutoModelForCausalLM

    from bench.trainer import task_data

    data = task_data(tmp_path)
    model_dir, build = R.prepare(tmp_path, "tiny", data, sft_threads=1)
    big = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    small = AutoModelForCausalLM.from_pretrained(tmp_path / "real-vocab-tiny" / "sft" / "model", dtype=torch.float32)
    assert big.config.vocab_size == R.VOCAB and big.config.tie_word_embeddings
    assert big.get_output_embeddings().weight.data_ptr() == big.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[1, 4, 20, 30, 2, 4, 1, 5, 4]])
    with torch.no_grad():
        b, s = big(ids).logits[0], small(ids).logits[0]
    assert b.shape[-1] == R.VOCAB
    # the same body and rows: the same logits on the demo's tokens, up to the GEMM's blocking at another V (fp32
    # rounding of 32-term dot products of unit-scale values: ~1e-6)
    assert torch.allclose(b[:, : s.shape[-1]], s, atol=1e-5, rtol=0)
    assert json.loads((model_dir.parent / "build.json").read_text()) == build
    again, _ = R.prepare(tmp_path, "tiny", data, sft_threads=1)  # reused: the stamp matches
    assert again == model_dir and (model_dir / "tokenizer.json").stat().st_size > 1_000_000
