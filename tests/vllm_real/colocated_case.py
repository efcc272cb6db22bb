"""One colocated-engine case against the real vLLM (CPU build), in a process of its own (one vLLM engine per
process, as in training): ``python tests/vllm_real/colocated_case.py SPEC_JSON OUT_JSON``.

Builds a tiny random model (SPEC: arch qwen2/llama, tie, bias), the engine through the trainer's factory
(``make_rollout_engine`` with ``rollout.engine=vllm``), then: the first weight sync (parameters and buffers,
as ``DeepSpeedPolicy.weight_buckets`` sends them), sampling, parity of vLLM's raw log-probs with the policy's
through fastcov's fused kernel (``PolicyModel`` -> ``linear_logprob_entropy``) on the same tokens, one
optimizer step, a sync, parity again and vLLM's changes against the policy's. Writes the numbers to
OUT_JSON; the test asserts on them. Last, with ``expect_buffer_error``, the pre-fix sync (buffers included)
and the error vLLM's loader gives for it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
EOS, VOCAB, NEW = 2, 512, 12


def build_policy(spec: dict):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    # vLLM's CPU attention takes head_dim 64 (not 16): hidden 128, 2 heads
    common = dict(vocab_size=spec.get("vocab", VOCAB), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2 if spec["arch"] == "llama" else 1,
                  max_position_embeddings=256, tie_word_embeddings=spec["tie"], bos_token_id=1,
                  eos_token_id=EOS, pad_token_id=0)
    if spec["arch"] == "llama":
        cfg = LlamaConfig(attention_bias=spec["bias"], mlp_bias=spec["bias"], **common)
        cls = LlamaForCausalLM
    else:
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM  # Qwen2: q/k/v biases always
    torch.manual_seed(spec.get("seed", 0))
    lm = cls(cfg).float()
    with torch.no_grad():  # random init is near-uniform; a sharper head gives log-probs that move
        lm.lm_head.weight.mul_(spec.get("head_scale", 3.0))
    return lm


def stats(a, b) -> dict:
    d = torch.cat([(torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)).abs()
                   for x, y in zip(a, b, strict=True)])
    return {"max": float(d.max()), "mean": float(d.mean()), "n": int(d.numel())}


def corr(a, b) -> float:
    x = torch.cat([torch.as_tensor(v, dtype=torch.float64) for v in a])
    y = torch.cat([torch.as_tensor(v, dtype=torch.float64) for v in b])
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1])


def sub(a, b):
    return [[float(x) - float(y) for x, y in zip(r, s, strict=True)] for r, s in zip(a, b, strict=True)]


def make_engine(lm, run_dir: str):
    from fastcov.trainer.config import load_config
    from fastcov.trainer.rollout import make_rollout_engine

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        "rollout.engine=vllm", "rollout.vllm_mode=colocated", f"trainer.run_dir={run_dir}",
        "rollout.sync_bucket_mb=0.25", f"rollout.max_new_tokens={NEW}", "data.max_prompt_len=32",
        "trainer.zero_stage=0", "trainer.device=cpu"])
    return make_rollout_engine(cfg, lm, NS(eos_token_id=EOS, pad_token_id=0), device=torch.device("cpu"),
                               zero_stage=0)


def policy_lp(lm, prompts, responses):
    from bench.vllm_smoke import bf16_copy, policy_logprobs

    with torch.no_grad():
        return [t.float().tolist() for t in policy_logprobs(bf16_copy(lm), prompts, responses)]


def sync(eng, lm) -> float:
    """The trainer's sync: parameters then buffers, as DeepSpeedPolicy.weight_buckets yields them."""
    from fastcov.trainer.runtime.weight_buckets import iter_buckets

    t0 = time.perf_counter()
    eng.update_weights(iter_buckets(list(lm.named_parameters()) + list(lm.named_buffers()), 256 << 10))
    return time.perf_counter() - t0


def train_step(lm, prompts, responses) -> None:
    """One Adam step raising the sampled responses' log-probs (policy in fp32, as on CPU)."""
    from bench.vllm_smoke import policy_logprobs

    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    loss = -torch.cat(policy_logprobs(lm, prompts, responses)).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def run(spec: dict, run_dir: str) -> dict:
    from bench.vllm_smoke import vllm_score
    from fastcov.trainer.rollout import SamplingParams
    from fastcov.trainer.runtime.distributed import init_distributed

    init_distributed(torch.device("cpu"))
    lm = build_policy(spec)
    t0 = time.perf_counter()
    eng = make_engine(lm, run_dir)
    res = {"spec": spec, "build_s": time.perf_counter() - t0, "engine": type(eng).__name__,
           "sleep_level": eng.sleep_level, "skip": sorted(eng.skip),
           "buffers": [n for n, _ in lm.named_buffers()]}
    res["sync_s"] = [sync(eng, lm), sync(eng, lm)]
    g = torch.Generator().manual_seed(0)
    prompts = [[1 + (7 * i + 3 * j) % (VOCAB - 3) for j in range(4 + i % 5)] for i in range(8)]
    batch = eng.generate(prompts, SamplingParams(1.0, 1.0, NEW), g)
    res["tokens"] = sum(len(r) for r in batch.token_ids)
    before = policy_lp(lm, prompts, batch.token_ids)
    res["parity_sampled"] = stats(batch.logprobs, before)
    v_before = vllm_score(eng, prompts, batch.token_ids)
    res["parity_scored"] = stats(v_before, before)
    train_step(lm, prompts, batch.token_ids)
    res["sync_after_step_s"] = sync(eng, lm)
    after = policy_lp(lm, prompts, batch.token_ids)
    v_after = vllm_score(eng, prompts, batch.token_ids)
    res["parity_after_step"] = stats(v_after, after)
    res["policy_change_mean"] = stats(after, before)["mean"]
    res["change_corr"] = corr(sub(v_after, v_before), sub(after, before))
    res["regenerated"] = sum(len(r) for r in eng.generate(prompts, SamplingParams(0.0, 1.0, NEW), g).token_ids)
    if spec.get("expect_buffer_error"):
        eng.skip = frozenset()  # the sync as it was before the fix: every buffer sent
        try:
            sync(eng, lm)
            res["buffer_error"] = None
        except ValueError as exc:
            res["buffer_error"] = str(exc).splitlines()[0][:200]
    return res


if __name__ == "__main__":
    from case_process import main

    main(run)
