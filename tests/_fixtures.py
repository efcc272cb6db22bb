"""What many tests share: the checkout's root, the tiny training config, the metrics that vary run to run, the
tiny model and prompts the rollout engines sample from, and the readers of bench/gpu_suite's output."""

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tiny Qwen2 and task every CPU training test runs (configs/tiny.yaml)
TINY = ROOT / "configs" / "tiny.yaml"
# metrics.jsonl keys that measure the machine, not the run: left out when two runs are compared
VOLATILE = ("time/", "tokens_per_s")


def odd_length_reward(self, text: str, truth: str) -> float:
    """RewardFn.__call__ for runs of an untrained model, which never answers right: 1 for an odd-length response,
    else 0, so a group's rewards differ and its advantages are non-zero (tests/trainer/conftest.py patches it in)."""
    return float(len(text) % 2)


# a study (trainer/experiments/study.py) at test size: a 2-step warm start on 64 problems, 4 held out (its setup
# arguments); runs of 2 prompts x 4 short answers (its overrides)
TINY_STUDY_SETUP = ("--sft-steps", "2", "--n-train", "64", "--n-val", "4")
TINY_STUDY_RUNS = ("trainer.eval_k=2", "trainer.prompts_per_step=2", "rollout.n=4", "algo.mini_batches=1",
                   "rollout.max_new_tokens=6", "trainer.progress=false")


def tiny(tmp_path: Path, name: str, *overrides: str):
    """configs/tiny.yaml training into ``tmp_path / name``, rewards scored in-process, then ``overrides`` (dotlist)."""
    from fastcov.trainer.config import load_config

    return load_config(TINY, [f"trainer.run_dir={Path(tmp_path) / name}", "reward.sandbox=inline", *overrides])


def tiny_on_cpu(tmp_path: Path, name: str, *overrides: str):
    """``tiny`` without evaluation, on the CPU: the runs that check what training does (LoRA's, for one)."""
    return tiny(tmp_path, name, "trainer.eval_every=0", "trainer.device=cpu", *overrides)


# rank-4 LoRA adapters on model.lora_targets' default modules (tests/trainer/runtime/test_lora.py and its e2e/ half)
LORA = ("model.lora_rank=4", "model.lora_alpha=8")


def stable(rows: list[dict], drop: tuple[str, ...] = VOLATILE) -> list[dict]:
    """metrics.jsonl rows without the keys that start with ``drop`` (by default those that measure the machine)."""
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


def tiny_lm(seed: int = 0, vocab: int = 97):
    """A tiny random Qwen2 (fp32, sdpa) whose eos (id 3) is likely enough that rows finish at different steps; pad 0."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                               max_position_embeddings=256, eos_token_id=3, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight[3] *= 6.0
    return model


def prompts_of(lengths: list[int], seed: int = 1, vocab: int = 97) -> list[list[int]]:
    """Random prompts of the given lengths, ids 4..vocab-1 (none of pad, eos or the other specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


def suite_rows(out: Path) -> list[dict]:
    """The rows bench/gpu_suite wrote under ``out`` (its one machine's folder), less the per-part timing rows."""
    import torch

    (path,) = (out / "cpu").glob("suite-*.jsonl") if not torch.cuda.is_available() else out.glob("*/suite-*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r["name"] != "part time"]


def suite_markdown(out: Path) -> str:
    """The markdown report bench/gpu_suite wrote under ``out``."""
    (path,) = out.glob("*/suite-*.md")
    return path.read_text()
