"""`fastcov plan` (fastcov/plan.py) against what a training process measures: the plan's CPU training total against
the peak resident memory of two steps of a tiny model in a fresh process (the hand computations:
tests/library/test_plan.py)."""

import json

import pytest

from fastcov.plan import ModelShape, plan_memory

_PEAK_WORKER = 'import json, sys, types\nimport torch\ntorch.set_num_threads(1)\nimport peft  # noqa: F401  (imported before the baseline: its import is not training memory)\nfrom transformers import AutoConfig, AutoModelForCausalLM\nfrom fastcov.trainer.runtime.lora import add_adapters\nfrom fastcov.trainer.runtime.model import PolicyModel\n\ndef status(field):\n    for line in open("/proc/self/status"):\n        if line.startswith(field):\n            return int(line.split()[1]) * 1024\n\narch, tokens, rank = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\nconfig = AutoConfig.for_model("qwen2", **arch)\nids = torch.randint(0, arch["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))\nlabels, mask = ids.roll(-1, 1), torch.ones_like(ids)\nbase = status("VmRSS:")\nmodel = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")\nif rank:\n    mcfg = types.SimpleNamespace(lora_rank=rank, lora_alpha=2.0 * rank, lora_dropout=0.0, quantization="none",\n                                 lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])\n    model = add_adapters(model, mcfg, torch.float32)\nmodel.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})\nmodel.config.use_cache = False\nmodel.train()\npolicy = PolicyModel(model)\nopt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)\nbuilt = status("VmRSS:") - base\nopen("/proc/self/clear_refs", "w").write("5")  # the high-water mark of the training steps starts here\nfor _ in range(2):\n    out = policy(ids, mask, labels)\n    (out.logprob.sum() + out.entropy.sum()).backward()\n    opt.step()\n    opt.zero_grad(set_to_none=False)\nprint(json.dumps({"peak": status("VmHWM:") - base, "built": built}))\n'

TINY_ARCH = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 2, "vocab_size": 32000, "tie_word_embeddings": False,
             "max_position_embeddings": 4096}


@pytest.mark.slow
@pytest.mark.parametrize("rank", [16, 0])
def test_cpu_plan_matches_measured_peak_memory(tmp_path, rank):
    """The plan's training total (fp32, as the trainer runs on a CPU) against the peak resident memory of two
    training steps of a tiny model (LoRA rank 16, and full fine-tuning) in a fresh process: within 15%.
    glibc's mmap threshold is pinned so that a freed tensor leaves the resident set (measurement only)."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc to read the peak resident memory")
    pytest.importorskip("peft")
    script = tmp_path / "peak.py"
    script.write_text(_PEAK_WORKER)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), json.dumps(TINY_ARCH), "1024", str(rank)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    shape = ModelShape.from_hf_config({**TINY_ARCH, "model_type": "qwen2"}, name="tiny")
    planned = plan_memory(shape, gpus=1, tokens_per_gpu=1024, zero_stage=0, lora_rank=rank,
                          precision="fp32").training_total
    assert abs(measured / planned - 1) < 0.15, f"measured {measured / 2**20:.0f} MiB, planned {planned / 2**20:.0f} MiB"
