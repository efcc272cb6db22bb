"""LoRA policies against the real vLLM (CPU build): the colocated engine serves the policy's adapters through
``enable_lora`` and a ``LoRARequest`` (one adapter directory per sync), takes the base weights once (an NF4 base
dequantized) and the adapters alone after. Each case runs in a process of its own
(tests/vllm_real/lora_case.py). Needs peft (and bitsandbytes for the NF4 case) in .venv-vllm: fastcov[lora]."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from case_process import run_case_process

CASE = Path(__file__).with_name("lora_case.py")
PARITY_MEAN = 0.02  # nats: bf16 vLLM against the policy through the fused kernel (an NF4 base: fp32 compute)
PARITY_MAX = 0.25


def run_case(spec: dict, tmp_path: Path) -> dict:
    for module in ("peft",) + (("bitsandbytes",) if spec["quant"] == "4bit" else ()):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"tests/vllm_real/test_lora.py needs {module} in this environment: "
                        "pip install -c requirements/dev.txt 'fastcov[lora]'", pytrace=False)
    return run_case_process(CASE, spec, tmp_path)[0]


@pytest.mark.parametrize("quant", ["none", "4bit"])
def test_colocated_vllm_serves_the_adapters_and_takes_only_them_after_the_first_sync(quant, tmp_path):
    res = run_case({"quant": quant}, tmp_path)
    assert res["engine"] == "VLLMColocatedEngine" and res["lora"]
    assert res["full_sync_bytes"] > 5 * res["adapter_bytes"]  # the base once
    assert res["adapter_sync_bytes"] == res["adapter_bytes"]  # then the adapters alone
    assert res["adapter_dirs"] == ["v000001", "v000002"]  # one directory per sync
    for key in ("parity", "parity_after"):
        assert res[key]["mean"] <= PARITY_MEAN and res[key]["max"] <= PARITY_MAX, (key, res[key])
    # vLLM really samples under the adapters, and under the new ones after the sync
    assert res["to_base"]["mean"] > 20 * res["parity"]["mean"]
    assert res["to_stale"]["mean"] > 5 * res["parity_after"]["mean"]
    if quant == "none":
        # the same greedy tokens as transformers, except where transformers' own top-2 margin is a near-tie
        for key in ("greedy", "greedy_after"):
            g = res[key]
            assert g["differ"] == 0 and g["equal"] + g["near_tie"] == res["prompts"], (key, g)
            assert g["equal"] >= res["prompts"] // 2, (key, g)  # near-ties are the exception
            if g["near_tie"]:
                print(f"{key}: {g['near_tie']} of {res['prompts']} prompts first differ at a near-tie: {g['details']}")
