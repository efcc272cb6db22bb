"""One LoRA case against the real vLLM (CPU build), in a process of its own (one vLLM engine per process):
``python tests/vllm_real/lora_case.py SPEC_JSON OUT_JSON``.

Builds a tiny random Qwen2 with rank-8 adapters (runtime.lora.add_adapters; SPEC ``quant``: "none" or
"4bit" for an NF4 base), moves the adapters off zero so they change the output, builds the colocated engine
through the trainer's factory (``model.lora_rank`` > 0: vLLM with ``enable_lora``), then: the first sync
(everything, as ``DeepSpeedPolicy.weight_buckets`` sends it), sampling, parity of vLLM's log-probs with the
adapted policy's and their distance to the base's (adapters off), greedy tokens against transformers' greedy
decoding of the same model; one step on the adapters, an adapter-only sync (the trainable parameters), and
parity again. Writes the numbers to OUT_JSON; tests/vllm_real/test_lora.py asserts on them.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # _agreement
EOS, VOCAB, NEW = 2, 512, 8
# A greedy step whose reference top-2 margin is below this many nats may flip between vLLM's bf16 kernels and
# transformers' (GEMM paths differ by ISA: AVX2, AVX-512, AMX): 2.5x the largest per-token log-prob gap measured
# between the two (0.020 nats, docs/vllm.md).
GREEDY_TIE_EPS = 0.05


def build_policy(spec: dict, cfg):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastcov.trainer.runtime.lora import add_adapters

    # vLLM's CPU attention takes head_dim 64: hidden 128, 2 heads; NF4 needs 64-wide inputs
    hf = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(hf).float()
    with torch.no_grad():
        lm.lm_head.weight.mul_(3.0)  # a sharper head: log-probs that move
    lm = add_adapters(lm, cfg.model, torch.float32).to("cpu")  # the move quantizes an NF4 base
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return lm.eval()


def make_engine(spec: dict, run_dir: str):
    from fastcov.trainer.config import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", [
        "rollout.engine=vllm", "rollout.vllm_mode=colocated", f"trainer.run_dir={run_dir}",
        "rollout.sync_bucket_mb=0.25", f"rollout.max_new_tokens={NEW}", "data.max_prompt_len=32",
        "trainer.zero_stage=0", "trainer.device=cpu", "model.lora_rank=8", "model.lora_alpha=16",
        f"model.quantization={spec['quant']}"])


def policy_lp(lm, prompts, responses, adapters: bool = True):
    """The policy's log-probs of the responses through fastcov's fused kernel, in bf16 as vLLM runs (an NF4
    base computes in the policy's own dtype)."""
    from bench.vllm_smoke import bf16_copy, policy_logprobs
    from fastcov.trainer.runtime.lora import adapters_disabled

    lm = lm if lm._fastcov_lora["quantization"] == "4bit" else bf16_copy(lm)
    with torch.no_grad():
        if adapters:
            return [t.float().tolist() for t in policy_logprobs(lm, prompts, responses)]
        with adapters_disabled(lm):
            return [t.float().tolist() for t in policy_logprobs(lm, prompts, responses)]


def hf_greedy(lm, prompts) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy decoding of the adapted model (bf16 like vLLM, except over an NF4 base): the tokens
    and, per step, the top-2 logit margin the argmax was decided by."""
    from _agreement import top2_margin

    from bench.vllm_smoke import bf16_copy

    lm = lm if lm._fastcov_lora["quantization"] == "4bit" else bf16_copy(lm)
    out, margins = [], []
    with torch.no_grad():
        for p in prompts:
            ids, steps = torch.tensor([p]), []
            for _ in range(NEW):
                logits = lm(input_ids=ids).logits[0, -1]
                steps.append(top2_margin(logits))
                nxt = int(logits.argmax())
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
                if nxt == EOS:
                    break
            out.append(ids[0, len(p):].tolist())
            margins.append(steps)
    return out, margins


def greedy_vs_hf(greedy, lm, prompts) -> dict:
    from _agreement import greedy_agreement

    ref, margins = hf_greedy(lm, prompts)
    return greedy_agreement(greedy, ref, margins, GREEDY_TIE_EPS)


def stats(a, b) -> dict:
    d = torch.cat([(torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)).abs()
                   for x, y in zip(a, b, strict=True)])
    return {"max": float(d.max()), "mean": float(d.mean()), "n": int(d.numel())}


def sync(eng, lm, trainable_only: bool) -> float:
    """The trainer's sync: everything (parameters then buffers) first, the trainable parameters after."""
    from fastcov.trainer.runtime.weight_buckets import iter_buckets

    named = ([(n, p) for n, p in lm.named_parameters() if p.requires_grad] if trainable_only
             else list(lm.named_parameters()) + list(lm.named_buffers()))
    eng.update_weights(iter_buckets(named, 256 << 10))
    return eng.stats["sync_bytes"]


def run(spec: dict, run_dir: str) -> dict:
    from fastcov.trainer.rollout import SamplingParams, make_rollout_engine
    from fastcov.trainer.runtime.distributed import init_distributed

    init_distributed(torch.device("cpu"))
    cfg = make_engine(spec, run_dir)
    lm = build_policy(spec, cfg)
    eng = make_rollout_engine(cfg, lm, NS(eos_token_id=EOS, pad_token_id=0), device=torch.device("cpu"),
                              zero_stage=0)
    adapter_bytes = sum(p.numel() * p.element_size() for p in lm.parameters() if p.requires_grad)
    res = {"engine": type(eng).__name__, "lora": eng.lora is not None, "adapter_bytes": adapter_bytes,
           "full_sync_bytes": sync(eng, lm, trainable_only=False)}
    prompts = [[1 + (7 * i + 3 * j) % (VOCAB - 3) for j in range(4 + i % 5)] for i in range(8)]
    g = torch.Generator().manual_seed(0)
    batch = eng.generate(prompts, SamplingParams(1.0, 1.0, NEW), g)
    res["parity"] = stats(batch.logprobs, policy_lp(lm, prompts, batch.token_ids))
    res["to_base"] = stats(batch.logprobs, policy_lp(lm, prompts, batch.token_ids, adapters=False))
    greedy = eng.generate(prompts, SamplingParams(0.0, 1.0, NEW), g).token_ids
    res["greedy"] = greedy_vs_hf(greedy, lm, prompts)
    before = copy.deepcopy(lm)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p), alpha=0.5)  # an adapter update, as a step would make
    res["adapter_sync_bytes"] = sync(eng, lm, trainable_only=True)
    res["adapter_dirs"] = sorted(p.name for p in eng.lora.root.iterdir())
    batch2 = eng.generate(prompts, SamplingParams(1.0, 1.0, NEW), g)
    res["parity_after"] = stats(batch2.logprobs, policy_lp(lm, prompts, batch2.token_ids))
    res["to_stale"] = stats(batch2.logprobs, policy_lp(before, prompts, batch2.token_ids))  # the old adapters
    greedy2 = eng.generate(prompts, SamplingParams(0.0, 1.0, NEW), g).token_ids
    res["greedy_after"] = greedy_vs_hf(greedy2, lm, prompts)
    res["prompts"] = len(prompts)
    return res


if __name__ == "__main__":
    from case_process import main

    main(run)
