"""GGUF files as a model source (trainer/runtime/gguf.py): a tiny model written here with the gguf package's own
writer, in llama.cpp's layout, loads exactly as the same weights saved as safetensors; a missing gguf package, an
architecture transformers cannot read and a directory with two files stop in one line. A run that converts, trains,
checkpoints and resumes: tests/trainer/e2e/test_gguf_e2e.py."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

import gguf
from _fixtures import ROOT
from _gguf import tiny_hf_model, write_gguf

from fastcov.errors import ConfigError
from fastcov.trainer.config import ModelConfig
from fastcov.trainer.runtime import gguf as gguf_mod
from fastcov.trainer.runtime.model import PolicyModel, build_model, check_model_source, load_tokenizer


def logprobs(model, seed: int = 1):
    """Per-token log-probs and entropies of the policy on random ids (odd length, a padded row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=g)
    att = torch.ones_like(ids)
    att[1, 7:] = 0
    labels = torch.roll(ids, -1, 1).masked_fill(att == 0, -100)
    with torch.no_grad():
        out = PolicyModel(model.eval())(ids, att, labels)
    return out.logprob, out.entropy


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("llama", False), ("qwen2", False)])
def test_gguf_loads_exactly_as_safetensors(tmp_path, model_type, tied):
    ref = tiny_hf_model(model_type, tied)
    ref.save_pretrained(tmp_path / "hf")  # safetensors
    write_gguf(ref, tmp_path / "tiny.gguf")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    cpu = torch.device("cpu")
    for path in (tmp_path / "tiny.gguf", tmp_path):  # the file, or the directory holding it
        direct = build_model(ModelConfig(path=str(path)), cpu, torch.float32)
        assert type(direct) is type(hf)
        sd, want = direct.state_dict(), hf.state_dict()
        assert sd.keys() == want.keys()
        for k in want:
            assert torch.equal(sd[k], want[k]), k  # F32 in the file: bit-exact, the q/k permutation undone
        for a, b in zip(logprobs(direct), logprobs(hf), strict=True):
            assert torch.equal(a, b)
    converted = gguf_mod.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted", torch.float32)
    assert (converted / "config.json").is_file() and (converted / gguf_mod.SOURCE_FILE).is_file()
    again = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert again.config.tie_word_embeddings == tied
    for a, b in zip(logprobs(again), logprobs(hf), strict=True):
        assert torch.equal(a, b)


def test_dequantized_to_the_runs_dtype(tmp_path):
    """A Q8_0 tensor reads back as gguf's own dequantization of the same bytes, then cast to the run's dtype
    (bf16 here): the same values as the fp32 load cast to bf16."""
    ref = tiny_hf_model("llama", tied=True)
    q = gguf.GGMLQuantizationType.Q8_0
    write_gguf(ref, tmp_path / "q.gguf", quantize={"blk.0.ffn_up.weight": q})
    want = gguf.dequantize(gguf.quantize(ref.model.layers[0].mlp.up_proj.weight.detach().numpy(), q), q)
    cpu = torch.device("cpu")
    m32 = build_model(ModelConfig(path=str(tmp_path / "q.gguf")), cpu, torch.float32)
    got = m32.model.layers[0].mlp.up_proj.weight
    assert torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32)))
    assert not torch.equal(got, ref.model.layers[0].mlp.up_proj.weight)  # it was quantized: the test can tell
    m16 = build_model(ModelConfig(path=str(tmp_path / "q.gguf")), cpu, torch.bfloat16)
    for (k, a), b in zip(m16.state_dict().items(), m32.state_dict().values(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16)), k


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    ref = tiny_hf_model("llama", tied=True)
    write_gguf(ref, tmp_path / "tiny.gguf")
    tok = load_tokenizer(ModelConfig(path=str(tmp_path / "tiny.gguf")))
    msgs = [{"role": "user", "content": "say the 12 cats"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nsay the 12 cats<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.convert_tokens_to_ids("<|im_start|>") in ids
    assert {tok.convert_tokens_to_ids("Ġthe"), tok.convert_tokens_to_ids("12")} <= set(ids)  # the merges are used
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    out = gguf_mod.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted", torch.float32)
    again = load_tokenizer(ModelConfig(path=str(out)))
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == text


def test_conversion_is_kept_for_the_same_file_and_redone_for_another(tmp_path):
    ref = tiny_hf_model("llama", tied=True)
    write_gguf(ref, tmp_path / "tiny.gguf")
    out = gguf_mod.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "c", torch.float32)
    stamp = (out / "config.json").stat().st_mtime_ns
    gguf_mod.convert_gguf(tmp_path / "tiny.gguf", out, torch.float32)
    assert (out / "config.json").stat().st_mtime_ns == stamp  # kept
    assert not gguf_mod.is_converted(out, tmp_path / "tiny.gguf", torch.bfloat16)
    gguf_mod.convert_gguf(tmp_path / "tiny.gguf", out, torch.bfloat16)
    assert json.loads((out / gguf_mod.SOURCE_FILE).read_text())["dtype"] == "torch.bfloat16"
    assert not (tmp_path / ".c.tmp").exists()


def test_bad_sources_stop_in_one_line(tmp_path, monkeypatch):
    ref = tiny_hf_model("llama", tied=True)
    write_gguf(ref, tmp_path / "a.gguf")
    write_gguf(ref, tmp_path / "odd.gguf", arch="rwkv6")
    two = tmp_path / "two"
    two.mkdir()
    write_gguf(ref, two / "x.gguf")
    write_gguf(ref, two / "y.gguf")
    cases = [(two, r"model\.path: .* holds 2 GGUF files \(x\.gguf, y\.gguf\)"),
             (tmp_path / "odd.gguf", r"model\.path: .*odd\.gguf.* holds a 'rwkv6' model, an architecture "
                                     r"transformers .* cannot read from GGUF \(it reads: .*llama"),
             (tmp_path / "none.gguf", r"model\.path: .*none\.gguf.* does not exist")]
    for path, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as exc:
            check_model_source(ModelConfig(path=str(path)))
        assert "\n" not in str(exc.value)
    monkeypatch.setattr(gguf_mod, "gguf_available", lambda: False)
    with pytest.raises(ConfigError, match=r"--model: .*a\.gguf.* needs the gguf package: pip install "
                                          r"'fastcov\[gguf\]'") as exc:
        check_model_source(ModelConfig(path=str(tmp_path / "a.gguf")), names=("--model", "--model"))
    assert "\n" not in str(exc.value)


def test_missing_gguf_package_exits_2_from_the_cli(tmp_path):
    """`fastcov train` with a .gguf model.path and no gguf package: one line, exit 2, nothing written."""
    ref = tiny_hf_model("llama", tied=True)
    write_gguf(ref, tmp_path / "a.gguf")
    code = ("import importlib.util, sys; real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n == 'gguf' else real(n, *a)\n"
            "from fastcov.cli import main; sys.exit(main(sys.argv[1:]))")
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", code, "train", str(ROOT / "configs" / "smollm2.yaml"),
                        f"model.path={tmp_path / 'a.gguf'}", f"trainer.run_dir={run}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()
    assert len(last) == 1 and "needs the gguf package: pip install 'fastcov[gguf]'" in last[0], p.stderr
    assert not run.exists()


def test_plan_reads_the_shape_from_the_header(tmp_path):
    from fastcov.plan import load_model_shape

    ref = tiny_hf_model("qwen2", tied=False)
    write_gguf(ref, tmp_path / "q.gguf")
    shape = load_model_shape(str(tmp_path / "q.gguf"))
    c = ref.config
    assert (shape.hidden_size, shape.intermediate_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
            shape.vocab_size, shape.tie_embeddings, shape.qkv_bias) == (
        c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
        c.vocab_size, False, True)
    assert load_model_shape(str(tmp_path)) == shape.__class__(**{**shape.__dict__, "name": str(tmp_path)})


def test_eval_reads_a_gguf_file_as_its_converted_directory(tmp_path, capsys, monkeypatch):
    """`fastcov eval --model <file.gguf>`: the same numbers as on the directory the run would convert it to.
    Both models' parameters are copied into fresh tensors first: safetensors loads are memory-mapped, and MKL's
    GEMM rounds differently at another alignment (measured: sequence confidence 0.04246354253 mapped against
    0.04246354391 fresh, the same on both sources once copied)."""
    from fastcov.cli import main
    from fastcov.trainer.data.chat_arith import Level, write_task
    from fastcov.trainer.runtime import model as model_mod

    build = model_mod.build_model

    def fresh(*a, **k):
        m = build(*a, **k)
        with torch.no_grad():
            for p in m.parameters():
                p.data = p.data.clone()
        m.tie_weights()
        return m

    monkeypatch.setattr(model_mod, "build_model", fresh)

    write_gguf(tiny_hf_model("llama", tied=True), tmp_path / "tiny.gguf")
    write_task(None, str(tmp_path / "val.parquet"), 0, 3, Level(1, 1))
    converted = gguf_mod.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted", torch.float32)
    got = []
    for model in (tmp_path / "tiny.gguf", converted):
        assert main(["eval", "--model", str(model), "--data", str(tmp_path / "val.parquet"), "--k", "2",
                     "--max-new-tokens", "5", "--temperature", "1.0", "--sample-all", "--device", "cpu", "--json"]) == 0
        got.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert got[0] == got[1] and got[0]["prompts"] == 3
