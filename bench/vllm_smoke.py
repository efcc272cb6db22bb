"""Colocated vLLM engine on one GPU, end to end, timed: the GPU check of docs/vllm.md (issue 13).

    python -m bench.vllm_smoke [--size tiny|7b] [--bucket-mb 64] [--out DIR]

One process plays a 1-rank trainer (RANK=0, WORLD_SIZE=1, as the deepspeed launcher would set). It builds a
random Qwen2 policy (fp32, as the trainer trains) and the engine exactly as the trainer does
(``make_vllm_engine``: in-process vLLM, ``load_format="dummy"``, sleep mode, the ``fastcov_local``
weight-transfer backend, raw log-probs), then:

  1. sync: ``update_weights(iter_buckets(policy))`` (timed; bf16 flat buckets through vLLM's
     start/update/finish_weight_update);
  2. generate (T=1, seeded) and compare vLLM's sampled-token log-probs with the policy's fused ones
     (``PolicyModel`` -> ``fastcov.linear_logprob_entropy``) on the same tokens;
  3. one optimizer step that raises the log-prob of those tokens; sync again (timed);
  4. score the same tokens with vLLM (prompt log-probs: raw, like the sampled ones) and check that vLLM's
     log-probs moved as the policy's did and match the new policy;
  5. generate again after the sync and check parity once more;
plus GPU memory freed by sleep level 2 and the wake/sleep/generate times. ``--size 7b`` builds a random
Qwen2.5-7B-shaped policy (30 GB fp32) and measures the sync of a 7B model (issue target: <= 2 s on an H100).

Tolerance (bf16): vLLM runs the model in bf16 (weights rounded from the fp32 policy, bf16 activations,
fp32 log-softmax); the policy reference runs the same bf16 weights with fastcov's fused kernel (fp32
accumulation). Per token |vLLM - policy| <= ATOL_MAX, mean <= ATOL_MEAN (nats). The check against the fp32
policy is reported, not asserted.

Last line printed: one JSON object (also written to <out>/vllm-smoke-<size>.json). Exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

ATOL_MAX = 0.1  # nats, any token
ATOL_MEAN = 0.02  # nats, mean over tokens
NEW_TOKENS = 16

SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 tie_word_embeddings=False),
    # Qwen2.5-7B's shape (random weights: nothing is downloaded)
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096,
               tie_word_embeddings=False, rope_theta=1000000.0),
}
EOS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_env() -> None:
    """What a 1-GPU deepspeed/torchrun launch sets, and vLLM's in-process mode."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                 "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
                 "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)


def build_policy(size: str, device):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(bos_token_id=1, eos_token_id=EOS, pad_token_id=0, **SIZES[size])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        lm = Qwen2ForCausalLM(cfg).float()
    return lm.eval()


def make_engine(lm, run_dir: str, bucket_mb: float, gpu_util: float, device):
    from fastcov.trainer.config import load_config
    from fastcov.trainer.rollout_vllm import make_vllm_engine

    root = Path(__file__).resolve().parent.parent
    cfg = load_config(root / "configs" / "tiny.yaml", [
        "rollout.engine=vllm", "rollout.vllm_mode=colocated", f"trainer.run_dir={run_dir}",
        f"rollout.sync_bucket_mb={bucket_mb}", f"rollout.vllm_gpu_memory_utilization={gpu_util}",
        f"rollout.max_new_tokens={NEW_TOKENS}", "data.max_prompt_len=64", "trainer.zero_stage=0"])
    return make_vllm_engine(cfg, lm, NS(eos_token_id=EOS), device=device, rank=0, world=1)


def policy_logprobs(lm, prompts, responses):
    """The policy's fused log-probs (fp32) of each response token given its prompt: [[float]]."""
    import torch

    from fastcov.trainer.runtime.model import PolicyModel

    dev = next(lm.parameters()).device
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        s = seqs[i]
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, len(p) - 1 : len(s) - 1] = torch.tensor(list(r))  # position t predicts token t+1
    out = PolicyModel(lm)(ids, mask, labels, temperature=1.0, entropy=False)
    return [out.logprob[i, len(p) - 1 : len(p) - 1 + len(r)]
            for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]


def vllm_score(engine, prompts, responses):
    """vLLM's raw log-probs of given response tokens (prompt log-probs of prompt+response), through the
    engine's own wake/sleep so the sleep state stays consistent."""
    from fastcov.trainer.rollout import SamplingParams
    from fastcov.trainer.rollout.vllm_wire import sampling_kwargs

    if not engine.weights_valid:  # after a level-2 sleep: the policy's current weights, as generate does
        engine.update_weights(engine.refresh())
    engine._wake(["weights", "kv_cache"])
    try:
        kw = sampling_kwargs(SamplingParams(1.0, 1.0, 1), [], None)
        params = engine.vllm.SamplingParams(**{**kw, "prompt_logprobs": 0})
        outs = engine.llm.generate([{"prompt_token_ids": list(p) + list(r)}
                                    for p, r in zip(prompts, responses, strict=True)],
                                   params, use_tqdm=False)
    finally:
        engine._sleep()
    res = []
    for o, p, r in zip(outs, prompts, responses, strict=True):
        pl = o.prompt_logprobs  # position j: {token_j: Logprob} (None at 0)
        res.append([float(pl[len(p) + k][tok].logprob) for k, tok in enumerate(r)])
    return res


def diff_stats(a, b) -> dict:
    import torch

    d = torch.cat([(torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64).cpu()).abs()
                   for x, y in zip(a, b, strict=True)])
    return {"max": float(d.max()), "mean": float(d.mean()), "n": int(d.numel())}


def bf16_copy(lm):
    import torch

    ref = copy.deepcopy(lm).to(torch.bfloat16)
    return ref


@dataclass
class Smoke:
    """What the steps of ``run`` share: the policy, the engine, the weight stream from one to the other,
    and the result being filled in."""

    dev: Any  # torch.device
    lm: Any  # the fp32 policy (transformers' Qwen2ForCausalLM)
    eng: Any  # the colocated vLLM engine (make_vllm_engine)
    named: list  # the policy's (name, tensor) pairs, parameters then buffers
    cap: int  # bucket size in bytes
    res: dict

    def sync(self) -> float:
        """One weight sync policy -> engine, timed to the end of its GPU work (seconds)."""
        import torch

        from fastcov.trainer.runtime.weight_buckets import iter_buckets

        t0 = time.perf_counter()
        self.eng.update_weights(iter_buckets(self.named, self.cap))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def check_parity(self, name: str, stats: dict) -> None:
        self.res["checks"][name] = stats["max"] <= ATOL_MAX and stats["mean"] <= ATOL_MEAN


def start_engine(lm, run_dir: str, bucket_mb: float, gpu_util: float, dev, res: dict) -> Smoke:
    """Build the engine (timed) and record its version and the GPU memory it leaves free asleep."""
    import torch

    from fastcov.trainer.runtime.weight_buckets import bucket_bytes_from_mb

    named = list(lm.named_parameters()) + list(lm.named_buffers())
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    eng = make_engine(lm, run_dir, bucket_mb, gpu_util, dev)
    import vllm

    res["vllm"] = vllm.__version__
    res["engine_build_s"] = time.perf_counter() - t0
    res["sleep_level"] = eng.sleep_level
    res["gpu_free_gib_after_build_and_sleep"] = torch.cuda.mem_get_info()[0] / 2**30
    res["gpu_free_gib_before_build"] = free0 / 2**30
    return Smoke(dev, lm, eng, named, bucket_bytes_from_mb(bucket_mb), res)


def first_syncs(s: Smoke, n: int) -> None:
    """Step 1: n timed syncs (the last one is the steady state) and their throughput."""
    import torch

    torch.cuda.synchronize()
    syncs = [s.sync() for _ in range(n)]
    s.res["sync_s"] = syncs
    s.res["sync_gib"] = s.eng.stats["sync_bytes"] / 2**30
    s.res["sync_gib_per_s"] = s.res["sync_gib"] / syncs[-1]


def check_7b(s: Smoke, syncs: int) -> None:
    """--size 7b: the sync time target and the GPU memory left free by a sleeping engine."""
    import torch

    first_syncs(s, syncs)
    s.res["checks"]["sync_7b_le_2s"] = s.res["sync_s"][-1] <= 2.0
    s.eng._wake(["kv_cache"])
    s.eng._sleep()
    s.res["gpu_free_gib_asleep"] = torch.cuda.mem_get_info()[0] / 2**30


def generate_and_compare(s: Smoke, prompts, g):
    """Step 2: generate, then vLLM's sampled-token log-probs against the policy's (bf16 and fp32 weights).
    Returns the batch and the fp32 policy's log-probs of its tokens."""
    import torch

    from fastcov.trainer.rollout import SamplingParams

    t0 = time.perf_counter()
    free_before = torch.cuda.mem_get_info()[0]
    b1 = s.eng.generate(prompts, SamplingParams(1.0, 1.0, NEW_TOKENS), g)
    s.res["generate_s"] = time.perf_counter() - t0
    s.res["gpu_free_gib_asleep"] = torch.cuda.mem_get_info()[0] / 2**30
    s.res["gpu_freed_by_sleep_gib"] = (torch.cuda.mem_get_info()[0] - free_before) / 2**30
    s.res["engine_stats"] = dict(s.eng.stats)
    ref16 = bf16_copy(s.lm)
    with torch.no_grad():
        pol16 = policy_logprobs(ref16, prompts, b1.token_ids)
        pol32 = policy_logprobs(s.lm, prompts, b1.token_ids)
    s.res["parity_before"] = {"vs_bf16_policy": diff_stats(b1.logprobs, pol16),
                              "vs_fp32_policy": diff_stats(b1.logprobs, pol32)}
    s.check_parity("parity_before", s.res["parity_before"]["vs_bf16_policy"])
    return b1, pol32


def step_policy(lm, prompts, responses) -> None:
    """One optimizer step that makes the given response tokens likelier."""
    import torch

    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3, weight_decay=0.0)
    lp = policy_logprobs(lm, prompts, responses)
    loss = -torch.cat(lp).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def check_after_step(s: Smoke, prompts, b1, pol32) -> None:
    """Steps 3 and 4: one policy step, a timed sync, and vLLM's scores of the same tokens: they moved as
    the policy's did and match the new policy."""
    import torch

    step_policy(s.lm, prompts, b1.token_ids)
    with torch.no_grad():
        pol_new32 = policy_logprobs(s.lm, prompts, b1.token_ids)
        pol_new16 = policy_logprobs(bf16_copy(s.lm), prompts, b1.token_ids)
    s.res["sync2_s"] = s.sync()
    v_new = vllm_score(s.eng, prompts, b1.token_ids)
    d_pol = torch.cat([a.cpu().double() - b.cpu().double() for a, b in zip(pol_new32, pol32, strict=True)])
    d_vllm = torch.cat([torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
                        for a, b in zip(v_new, b1.logprobs, strict=True)])
    corr = float(torch.corrcoef(torch.stack([d_pol, d_vllm]))[0, 1])
    s.res["after_step"] = {"policy_mean_change": float(d_pol.mean()), "vllm_mean_change": float(d_vllm.mean()),
                           "corr_of_changes": corr, "vs_new_bf16_policy": diff_stats(v_new, pol_new16),
                           "vs_new_fp32_policy": diff_stats(v_new, pol_new32)}
    s.res["checks"]["logprobs_changed"] = float(d_vllm.abs().mean()) > 5 * ATOL_MEAN
    s.res["checks"]["changed_as_policy"] = corr > 0.9
    s.check_parity("parity_after_sync", s.res["after_step"]["vs_new_bf16_policy"])


def generate_after_sync(s: Smoke, prompts, g, b1) -> None:
    """Step 5: generate with the synced weights; parity once more, and both batches' lengths."""
    import torch

    from fastcov.trainer.rollout import SamplingParams

    t0 = time.perf_counter()
    b2 = s.eng.generate(prompts, SamplingParams(1.0, 1.0, NEW_TOKENS), g)
    s.res["generate2_s"] = time.perf_counter() - t0
    with torch.no_grad():
        pol2 = policy_logprobs(bf16_copy(s.lm), prompts, b2.token_ids)
    p = diff_stats(b2.logprobs, pol2)
    s.res["parity_generate_after_sync"] = p
    s.check_parity("parity_generate_after_sync", p)
    s.res["checks"]["lengths"] = all(0 < len(t) <= NEW_TOKENS for t in b1.token_ids + b2.token_ids)


def check_tiny(s: Smoke) -> None:
    """--size tiny: steps 1 to 5."""
    import torch

    first_syncs(s, 1)
    g = torch.Generator(device=s.dev).manual_seed(0)
    prompts = [[1, 17, 42, 99, 7], [1, 200, 3, 3, 150, 64, 11], [1, 5], [1, 300, 301, 302]] * 2
    b1, pol32 = generate_and_compare(s, prompts, g)
    check_after_step(s, prompts, b1, pol32)
    generate_after_sync(s, prompts, g, b1)


def run(size: str = "tiny", bucket_mb: float = 64.0, gpu_util: float = 0.3, out: Path | None = None) -> dict:
    import torch

    single_rank_env()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    res: dict = {"size": size, "bucket_mb": bucket_mb, "gpu": torch.cuda.get_device_name(0),
                 "torch": torch.__version__, "checks": {}}
    lm = build_policy(size, dev)
    res["params"] = sum(p.numel() for p in lm.parameters())
    with tempfile.TemporaryDirectory() as run_dir:
        s = start_engine(lm, run_dir, bucket_mb, gpu_util, dev, res)
        if size == "7b":
            check_7b(s, syncs=2)  # the second sync is the steady state
        else:
            check_tiny(s)
        s.eng.close()
    res["tolerance"] = {"max": ATOL_MAX, "mean": ATOL_MEAN}
    res["ok"] = all(res["checks"].values())
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"vllm-smoke-{size}.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--gpu-util", type=float, default=0.3, help="rollout.vllm_gpu_memory_utilization")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    a = ap.parse_args(argv)
    res = run(a.size, a.bucket_mb, a.gpu_util, a.out)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
