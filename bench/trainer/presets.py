"""What the trainer benchmark runs: the presets (sizes per device), the cases and their kinds, the real
models' cases, the held-out evaluation's settings."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Presets: the model (a Qwen2 config on the demo's tokenizer), its warm start, and the RL run's size.
PRESETS: dict[str, dict] = {
    # the CPU run: the trainers one after the other, each with both of a 2-core machine's threads (at one thread
    # each the six cases took 29 min 15 s on a 2-core AMD EPYC, 20 of them at the 151,936-token vocabulary)
    "cpu": dict(device="cpu", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, sft_steps=150,
                sft_lr=3e-3, prompts=16, n=8, max_new=32, long_new=128, mini_batches=8, lr=1e-4, steps=8,
                warmup=1, threads=2, pool=32, logprob_budget=2048),
    # seconds, for the test: a tiny model, two rollout batches of 2 prompts x 4
    "tiny": dict(device="cpu", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, sft_steps=10,
                 sft_lr=3e-3, prompts=2, n=4, max_new=8, long_new=24, mini_batches=2, lr=1e-4, steps=1,
                 warmup=1, threads=1, eval_prompts=8, pool=4),
    # Qwen2.5-1.5B's decoder (28 layers, hidden 1536, 12 heads / 2 KV heads, MLP 8960) on the demo's vocabulary
    "gpu-1.5b": dict(device="cuda", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, sft_steps=150,
                     sft_lr=1e-4, prompts=16, n=8, max_new=32, long_new=256, mini_batches=8, lr=1e-6, steps=8,
                     warmup=1, threads=0, pool=64),
}
# The held-out evaluation run by the bench itself, the same code for the warm start and for every trained model:
# fastcov's ``evaluate_model`` (its HF engine) on the first ``prompts`` problems of the demo's val.parquet, ``k``
# answers each at the rollout temperature, a fixed seed; ``eval_mean`` is the mean reward of the prompts x k answers.
EVAL = dict(prompts=128, k=8, temperature=1.0, seed=0)
# The training pool: both trainers draw their prompts from the first ``pool`` problems of train.parquet (a preset
# value), each seen again every pool / prompts rollout batches, so that a few batches of GRPO measurably raise the
# reward on them; ``pool_before`` / ``pool_after`` evaluate the pool itself (``POOL_K`` answers per prompt, the
# rest as ``EVAL``). 0: the whole file.
POOL_K = 16
# The arms of each case (fastcov's trainer first; the ratios are each other arm's over it) and what the case does:
# "similar" answers of the model's own lengths, "long" one answer per rollout batch forced to long_new (ForceLong),
# "kl_cov" KL-Cov in both trainers.
CASES = {"a": ("fastcov", "trl"), "b": ("fastcov", "trl"), "c": ("fastcov", "trl+fastcov"), "d": ("fastcov", "trl"),
         "e": ("fastcov", "trl", "trl+liger"), "f": ("fastcov", "trl", "trl+liger"), "g": ("fastcov", "trl+fastcov")}
CASE_NAMES = {"a": "similar-length", "b": "one-long", "c": "kl-cov", "d": "smollm2", "e": "vocab-similar-length",
              "f": "vocab-one-long", "g": "vocab-kl-cov"}
CASE_KIND = {"a": "similar", "b": "long", "c": "kl_cov", "d": "similar", "e": "similar", "f": "long", "g": "kl_cov"}
DEFAULT_CASES = "a,b,c,e,f,g"
# Cases on a pretrained model instead of the preset's warm start: ``model`` (a demo_real preset, a GGUF file or a
# Hugging Face directory), converted once into ``<work>/<case name>/model``; the task, chat arithmetic at ``level``
# (trainer/data/chat_arith.py) in ``<work>/<case name>/data``; ``sizes`` replace the preset's (for both trainers
# alike); ``config`` overrides go to fastcov's run. Every other setting is the preset's, as in the other cases.
MODEL_CASES: dict[str, dict] = {
    # configs/smollm2.yaml's size and task level (make demo-real picked d2o1: the start model's pass@8 0.625):
    # 4 prompts x 8 rollouts, 32 new tokens, 2 optimizer steps per batch, lr 5e-5; 1 + 2 rollout batches, the pool
    # of 4 prompts and 8 held-out ones evaluated. 135M parameters: at load ~22 on the 2 cores fastcov's run passed the
    # default --case-timeout of 900 s, so this case waits up to an hour per trainer
    "d": dict(model="smollm2", level="d2o1", config=["data.max_prompt_len=256"], timeout=3600.0,
              sizes=dict(prompts=4, n=8, max_new=32, long_new=32, mini_batches=2, lr=5e-5, steps=2, warmup=1,
                         pool=4, pool_k=8, eval_prompts=8, logprob_budget=2048)),
}
# Cases e-g: bench/real_vocab.py's model, Qwen2.5's 151,936-token vocabulary and tied head (on CPU Qwen2.5-0.5B's
# 151,936 x 896 head over a 2-layer body; gpu-1.5b: Qwen2.5-1.5B's shape), warm-started on the demo's task and
# built once into <work>/real-vocab-<preset>; the demo's task and pool file. A token costs ~15x a case-a token on
# CPU (49 against 740 tokens/s in bench/results/cpu-2core/trainer-2026-11-28.jsonl), so there the sizes are smaller
# (for both trainers alike): 4 prompts x 8 rollouts, 2 optimizer steps of 16 sequences per rollout batch, 1 warm-up
# + 2 measured batches, a pool of 4 prompts (every rollout batch sees all of them) evaluated with 16 answers each,
# 16 held-out prompts. ``sizes`` by preset: the others keep their own.
REAL_VOCAB_CASE = dict(real_vocab=True, timeout=1800.0, sizes={"cpu": dict(
    prompts=4, n=8, max_new=32, long_new=128, mini_batches=2, lr=2e-4, steps=2, warmup=1, pool=4, pool_k=16,
    eval_prompts=16, logprob_budget=2048)})
MODEL_CASES.update(e=REAL_VOCAB_CASE, f=REAL_VOCAB_CASE, g=REAL_VOCAB_CASE)
KL_COV = dict(ratio=0.5, coef=1.0)  # configs/demo.yaml's KL-Cov


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
