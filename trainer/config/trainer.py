"""The ``trainer`` section: the run directory, steps and batch sizes, ZeRO, evaluation, checkpoints, trackers."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from fastcov.trainer.config.base import check as _check


@dataclass
class TrainerConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    max_steps: int = 100
    prompts_per_step: int = 16  # global, over all data-parallel ranks
    micro_token_budget: int = 8192  # tokens per micro-batch and rank (prompt + response)
    # The same for step 4's no-grad pass over the whole rollout batch (the old log-probs; verl's
    # log_prob_max_token_len_per_gpu); None: micro_token_budget. On CPU smaller is faster, the activations
    # staying in cache (python -m bench.logprob_profile, hidden 256: 1024-2048 took 0.74-0.76x of 8192's
    # time with both cores busy, 1024 0.91x on a quieter machine).
    logprob_token_budget: int | None = None
    # Concatenate several sequences per row (attention confined to each: a block-diagonal causal mask,
    # or flash-attn's position-id packing) instead of one padded sequence per row. Same log-probs; less
    # padding (CPU, hidden 256 x 4 layers, mixed lengths: 1.7x the tokens/s of padding; equal when lengths are uniform).
    packing: bool = True
    zero_stage: int = 0
    # ZeRO-Offload: keep the fp32 master weights and Adam moments (12 bytes/parameter / world) in host
    # memory and step them there (DeepSpeed's CPU Adam); needs zero_stage >= 1. What fits Qwen2.5-32B on
    # 8 x 80 GB (fastcov plan --config configs/qwen2.5-32b-kl-cov.yaml).
    offload_optimizer: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # CPU runs: torch intra-op threads, pinned so that a seed gives the same numbers on machines with
    # different core counts (0: torch's default, which follows the machine and OMP_NUM_THREADS).
    threads: int = 1
    # Multi-rank runs: seconds a collective waits for a peer before the run stops with one line naming the
    # lost rank and the last intact checkpoint (0: DeepSpeed's default, 30 min). Longer than any step phase
    # where ranks wait on each other (a node's first rank sampling for the node, a checkpoint write).
    collective_timeout_s: float = 0.0
    # Modules imported before the config is checked: where a user registers a loss mode
    # (fastcov.losses.register), an advantage estimator or a reward task, then names it in YAML.
    imports: list[str] = field(default_factory=list)
    eval_every: int = 10  # 0 = never; evaluation also runs at step 0 and at the end
    eval_k: int = 1
    eval_temperature: float = 0.6  # for data sources aime/aime25/amc; others are greedy
    # Sample eval_k responses at eval_temperature for every data source (pass@k, diversity for all).
    eval_sample_all: bool = False
    eval_max_new_tokens: int | None = None  # None: rollout.max_new_tokens
    save_every: int = 0  # 0 = only at the end and on Ctrl-C (and by save_every_minutes)
    # A checkpoint at the first step end this many minutes after the last one (0 = off): a crash loses at
    # most this much work whatever save_every is.
    save_every_minutes: float = 30.0
    # Gradient checkpointing's saved layer inputs go to pinned host memory during the forward and come
    # back for the backward (needs model.gradient_checkpointing; on CPU there is nowhere to offload to: a no-op).
    offload_activations: bool = False
    keep_last: int = 2
    progress: bool = True
    # Write <run>/timeline.jsonl: every phase's start and end, and an asynchronous engine's busy spans (docs/async.md).
    timeline: bool = False
    # Where the metrics go besides metrics.jsonl (TRL's report_to, verl's trainer.logger), through accelerate's
    # trackers: tensorboard (pip install 'fastcov[tensorboard]'; <run_dir>/tensorboard), wandb, mlflow, comet_ml,
    # aim, clearml, dvclive, swanlab, trackio, or one a trainer.imports module registers
    # (accelerate.tracking.register_tracker_class); "all": every installed one; [] or "none": none.
    report_to: str | list[str] = field(default_factory=list)
    project: str = "fastcov"  # the trackers' project (W&B project, MLflow experiment); runs are named by run_dir
    # A Hub repo id (user/name): at the end of a run that reaches max_steps rank 0 uploads final/ there
    # (huggingface_hub; token from HF_TOKEN or `hf auth login`), as `fastcov push RUN_DIR --repo ID` does.
    push_to_hub: str | None = None

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        t = self
        _check(t.max_steps >= 0, "trainer.max_steps", "must be >= 0")
        _check(t.prompts_per_step >= 1, "trainer.prompts_per_step", "must be >= 1")
        _check(t.micro_token_budget >= 1, "trainer.micro_token_budget", "must be >= 1")
        _check(t.logprob_token_budget is None or t.logprob_token_budget >= 1, "trainer.logprob_token_budget",
               f"must be >= 1 or null (= trainer.micro_token_budget), got {t.logprob_token_budget}")
        _check(t.threads >= 0, "trainer.threads", f"must be >= 0 (0 = torch's default), got {t.threads}")
        _check(t.collective_timeout_s >= 0, "trainer.collective_timeout_s",
               f"must be >= 0 (0 = DeepSpeed's default), got {t.collective_timeout_s}")
        _check(t.zero_stage in (0, 1, 2, 3), "trainer.zero_stage", f"must be 0, 1, 2 or 3, got {t.zero_stage}")
        _check(not t.offload_optimizer or t.zero_stage >= 1, "trainer.offload_optimizer",
               "offloading the optimizer states needs trainer.zero_stage >= 1")
        _check(t.eval_every >= 0, "trainer.eval_every", "must be >= 0")
        _check(t.eval_k >= 1, "trainer.eval_k", "must be >= 1")
        _check(t.save_every >= 0, "trainer.save_every", "must be >= 0")
        _check(t.save_every_minutes >= 0, "trainer.save_every_minutes", "must be >= 0 (0 = off)")
        _check(t.keep_last >= 1, "trainer.keep_last", "must be >= 1")
        _check(t.push_to_hub is None or re.fullmatch(r"[\w.-]+(/[\w.-]+)?", t.push_to_hub) is not None,
               "trainer.push_to_hub", f"must be a Hub repo id (namespace/name) or null, got {t.push_to_hub!r}")

