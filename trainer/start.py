"""The run's set-up, before the loop's first step: checks, data, policy, rollout engine, rewards, RNG, a resumed
state, the run's files; and ``Run``, everything the loop carries between steps.

Everything a user can get wrong is checked before the first write (``_check_and_prepare``), so a run that
stops with a user error leaves the disk as it was.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastcov.errors import one_line
from fastcov.trainer.config import Config, ConfigError
from fastcov.trainer.controls import Controls, start_controls
from fastcov.trainer.data.loading import PromptSampler, load_train_val, prepare_data
from fastcov.trainer.rewards import REWARD_TASKS, RewardTask
from fastcov.trainer.rollout import make_rollout_engine
from fastcov.trainer.rollout.base import RolloutEngine
from fastcov.trainer.rollout.vllm_api import check_vllm_version
from fastcov.trainer.runtime.checkpoint import CheckpointError, load_checkpoint
from fastcov.trainer.runtime.dependencies import check_optional_packages
from fastcov.trainer.runtime.distributed import init_distributed, pick_device
from fastcov.trainer.runtime.errors import user_error
from fastcov.trainer.runtime.gguf import convert_for_run
from fastcov.trainer.runtime.lora import count_parameters
from fastcov.trainer.runtime.model import PolicyModel, build_model, check_model_source, load_tokenizer, use_liger
from fastcov.trainer.runtime.policy import DeepSpeedPolicy, ds_config
from fastcov.trainer.runtime.precision import param_dtype
from fastcov.trainer.runtime.run_dir import (
    check_run_dir,
    checkpoints_dir,
    hold_run_dir,
    io_error,
    metrics_path,
    prepare_run_dir,
    trim_metrics,
)
from fastcov.trainer.runtime.run_log import open_run_files
from fastcov.trainer.timeline import close_timeline, open_timeline, timeline_span
from fastcov.trainer.token_level.advantages import make_token_advantages

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Run:
    """Everything a training run holds between steps (built by ``start_run``)."""

    cfg: Config
    device: torch.device
    rank: int
    world: int
    run_dir: Path
    tokenizer: Any
    train_set: list
    val_set: list
    engine: DeepSpeedPolicy
    rollout: RolloutEngine
    reward_fn: RewardTask
    token_adv: Any  # REINFORCE++'s KL / PRIME's token-level advantages, or None
    sampler: PromptSampler
    gens: dict[str, torch.Generator]
    controls: Controls  # Jin et al.'s λ schedule, the target-entropy controller (trainer/controls.py)
    counters: dict[str, int]
    step: int = 0
    logger: Any = None
    pbar: Any = None
    warned: dict[str, bool] = field(default_factory=lambda: {"empty_band": False})
    last_save: float = field(default_factory=lambda: time.monotonic())  # for trainer.save_every_minutes
    synced: bool = False  # a first weight sync has happened (LoRA: later ones send the adapters only)
    source: Any = None  # rollout.async: where the batches come from (trainer/rollout/staleness.py); None when off
    pushed: bool = False  # rollout.async: the engine has had a push (the first one is never skipped)

    @property
    def ckpt_root(self) -> Path:
        return checkpoints_dir(self.run_dir)

    def trainer_state(self) -> dict:
        sampler = self.source.sampler_state() if self.source is not None else self.sampler.state_dict()
        return {"step": self.step, "sampler": sampler, "counters": self.counters, "world": self.world,
                **self.controls.state_dict(), **({"async": self.source.state()} if self.source is not None else {})}

    def eval_due(self, step: int) -> bool:
        """Whether the loop evaluates after ``step`` (end_step's rule)."""
        t = self.cfg.trainer
        return bool(t.eval_every and self.val_set and (step % t.eval_every == 0 or step == t.max_steps))



def start_run(cfg: Config, resume, overwrite: bool, closing: contextlib.ExitStack) -> Run:
    """Checks, data, policy, rollout engine, rewards, RNG, a resumed state, the metrics log, a progress bar."""
    t, a = cfg.trainer, cfg.algo
    device, rank, world, resume_path, tokenizer, train_set, val_set, data_stats, lock = _check_and_prepare(
        cfg, resume, overwrite, closing)
    engine, token_adv = build_policy(cfg, device, rank, world, tokenizer)
    rollout, reward_fn = build_rollout(cfg, engine, device, rank, world, tokenizer, closing)
    seed_everything(t.seed + 1000 * rank)
    gens = {"sample": torch.Generator(device=device).manual_seed(t.seed * 1_000_003 + rank),
            "select": torch.Generator(device=device).manual_seed(t.seed * 1_000_033 + rank + 17)}
    run = Run(cfg, device, rank, world, Path(t.run_dir), tokenizer, train_set, val_set, engine, rollout, reward_fn,
              token_adv, PromptSampler(len(train_set), t.seed), gens,
              start_controls(a, rank),  # λ's schedule and the entropy controller (or None); KL-Cov's warning
              {"skipped_steps": 0, "filtered_groups": 0, "reward_timeouts": 0})
    if cfg.rollout.async_mode != "off":
        run.source = start_source(run, closing)
    if resume_path is not None:
        _resume(run, resume_path)
    if rank == 0:
        run.logger = open_run_files(run.run_dir, cfg.to_dict(), t, run.step if resume_path is not None else None,
                                    closing)
        if t.timeline:
            open_timeline(run.run_dir / "timeline.jsonl")
            closing.callback(close_timeline)
        logger.info(f"run {run.run_dir}: {len(train_set)} train / {len(val_set)} val prompts "
                    f"({json.dumps(data_stats)}), world {world}, device {device}, zero {t.zero_stage}, "
                    f"mode {a.mode}")
        if t.progress:
            from tqdm.auto import tqdm

            # in a log file (not a terminal) a line every 30 s instead of one per step
            run.pbar = tqdm(total=t.max_steps, initial=run.step, desc=f"train {a.mode}", dynamic_ncols=True,
                            mininterval=0.1 if sys.stderr.isatty() else 30.0)
            closing.callback(run.pbar.close)
    if lock is not None:
        lock.started = True  # from here a failure keeps what the run made (checkpoints, metrics, data/)
    return run



def _check_and_prepare(cfg: Config, resume, overwrite: bool, closing: contextlib.ExitStack):
    """Setup up to the first write. Everything a user can get wrong is checked before it: nothing on disk
    changes when a run stops with a user error (bad run dir, --resume target, model path, data file).
    Returns (device, rank, world, resume_path, tokenizer, train_set, val_set, data_stats, the run dir's lock on
    rank 0 or None): until the run marks the lock started, a failure abandons the directory (RunDirLock.close)."""
    t = cfg.trainer
    try:
        device = pick_device(t.device)
    except ValueError as exc:
        raise user_error(exc) from None
    if device.type == "cpu" and t.threads:
        # results must not depend on the machine's core count; a run in a caller's process gives its count back
        closing.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(t.threads)
    rank, world = init_distributed(device, t.collective_timeout_s)
    if t.prompts_per_step % world:
        raise ConfigError(f"trainer.prompts_per_step: {t.prompts_per_step} is not divisible by the "
                          f"{world} data-parallel ranks; pick a multiple of {world}")
    run_dir = Path(t.run_dir)
    lock = hold_run_dir(run_dir, rank)
    try:
        setup = _checked_setup(cfg, resume, overwrite, device, rank, world, lock)
    except BaseException:
        if lock is not None:
            lock.abandon()  # a user error leaves the disk as it was
        raise
    if lock is not None:
        closing.push(lock.close)
    return (*setup, lock)


def _checked_setup(cfg: Config, resume, overwrite: bool, device, rank: int, world: int, lock):
    t = cfg.trainer
    run_dir = Path(t.run_dir)
    resume_path = check_run_dir(run_dir, resume, overwrite, rank)
    check_model_source(cfg.model)
    check_optional_packages(cfg, {"vllm": check_vllm_version})
    try:
        use_liger(cfg.model.liger, device)
    except ValueError as exc:
        raise user_error(exc) from None
    dist.barrier()  # every rank has checked before rank 0 moves or writes anything
    seed_everything(t.seed)  # identical model init on every rank
    try:
        tokenizer = load_tokenizer(cfg.model)
    except ValueError as exc:
        raise user_error(exc) from None
    if not cfg.data.synthetic.enabled:  # the user's files, read (and checked) before any write
        train_set, val_set, data_stats = load_train_val(cfg, tokenizer, *prepare_data(cfg, tokenizer, run_dir, rank))
    if rank == 0:
        try:
            if prepare_run_dir(run_dir, overwrite) is not None:
                lock.move_to(run_dir)  # the old run went aside with its lock file
        except OSError as exc:
            raise io_error(run_dir, exc) from None
    dist.barrier()
    convert_for_run(cfg.model, run_dir, param_dtype(cfg.model, device), rank)  # a .gguf model.path, once per run
    if cfg.data.synthetic.enabled:
        train_files, val_files = prepare_data(cfg, tokenizer, run_dir, rank)
        dist.barrier()
        train_set, val_set, data_stats = load_train_val(cfg, tokenizer, train_files, val_files)
    return device, rank, world, resume_path, tokenizer, train_set, val_set, data_stats



def build_policy(cfg: Config, device: torch.device, rank: int, world: int, tokenizer) -> tuple[DeepSpeedPolicy, Any]:
    """(policy engine, token-level advantages or None)."""
    try:
        lm = build_model(cfg.model, device, param_dtype(cfg.model, device), tokenizer,
                         ds_config=ds_config(cfg, device, world))
    except ValueError as exc:
        raise user_error(exc) from None
    # REINFORCE++'s KL reference, PRIME's reference and reward model: copies of the starting weights,
    # taken before DeepSpeed wraps (and under ZeRO-3 shards) the policy (with LoRA no reference copy)
    token_adv = make_token_advantages(cfg, lm)
    engine = DeepSpeedPolicy(PolicyModel(lm), cfg, device, world)
    if token_adv is not None:
        token_adv.bind_policy(engine)  # LoRA: the reference is the policy with its adapters off
    if engine.frozen_base and rank == 0:
        trainable, total = count_parameters(lm)
        base = " on a 4-bit base" if cfg.model.quantization == "4bit" else ""
        logger.info(f"LoRA rank {cfg.model.lora_rank}{base}: {trainable:,} of {total:,} parameters train")
    return engine, token_adv


def build_rollout(cfg: Config, engine: DeepSpeedPolicy, device: torch.device, rank: int, world: int, tokenizer,
                  closing: contextlib.ExitStack) -> tuple[RolloutEngine, RewardTask]:
    """(rollout engine, reward function); the reward function's workers close with ``closing``."""
    if cfg.rollout.async_mode != "off":  # beside the trainer: the HF engine's own process, or vLLM servers
        from fastcov.trainer.rollout.async_engine import make_async_engine

        rollout: RolloutEngine = make_async_engine(cfg, engine.policy.lm, tokenizer, device=device, rank=rank,
                                                   world=world, run_dir=Path(cfg.trainer.run_dir),
                                                   on_span=timeline_span if rank == 0 else None)
        closing.callback(rollout.close)
    else:
        # the HF engine samples from the policy's own module (ZeRO 0-2) or one empty copy per node (ZeRO-3)
        rollout = make_rollout_engine(cfg, engine.policy.lm, tokenizer, device=device, rank=rank, world=world,
                                      zero_stage=cfg.trainer.zero_stage)
    reward_fn = REWARD_TASKS.get(cfg.reward.task)(cfg.reward)  # math: \boxed{} answers; code: a sandbox
    closing.callback(reward_fn.close)
    return rollout, reward_fn


def start_source(run: Run, closing: contextlib.ExitStack):
    """rollout.async: the source of the run's batches (trainer/rollout/staleness.py); a dead engine process is
    restarted with the policy's whole weights."""
    from fastcov.trainer.rollout.async_engine import AsyncEngine
    from fastcov.trainer.rollout.staleness import make_source

    engine = run.rollout
    assert isinstance(engine, AsyncEngine), type(engine)  # build_rollout's, for rollout.async
    source = make_source(run.cfg, engine, run.sampler, run.train_set, run.rank, run.counters, run.device, run.eval_due)
    engine.full_weights = lambda: run.engine.weight_buckets(run.cfg.rollout.sync_bucket_mb)
    closing.callback(source.close)
    return source


def _resume(run: Run, path: Path) -> None:
    """Model, optimizer, RNG, data position, counters, λ and PRIME's reward model from a checkpoint."""
    state = load_checkpoint(path, run.engine, run.gens, run.rank)
    run.step = state["step"]
    try:
        run.sampler.load_state_dict(state["sampler"])
        run.counters.update(state["counters"])
        run.controls.load_state_dict(state)
        if run.source is not None:
            run.source.load_state(state.get("async"))
            run.source.load(path, run.step)  # one_step: this rank's finished batch of the next step
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"--resume: {str(path)!r} does not fit this run's config or data "
                              f"({type(exc).__name__}: {one_line(exc)})") from None
    if run.token_adv is not None and run.token_adv.prm is not None:
        try:
            run.token_adv.prm.load(path)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"--resume: PRIME's reward model: {one_line(exc)}") from None
    if run.rank == 0:
        logger.info(f"resumed from {path} at step {run.step}")
        trimmed = trim_metrics(metrics_path(run.run_dir), run.step)
        if trimmed["dropped"] or trimmed["torn"]:
            logger.info(f"metrics.jsonl: dropped {trimmed['dropped']} row(s) after step {run.step}"
                        f"{' and a torn last line' if trimmed['torn'] else ''}")

