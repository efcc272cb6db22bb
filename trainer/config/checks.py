"""The checks a section cannot make alone: names against their registries (after ``trainer.imports``), trackers,
and the rules that read more than one section. ``validate`` runs each section's own ``validate()`` too."""

from __future__ import annotations

import dataclasses
import difflib

from fastcov.entropy_control import KNOBS, ArgumentError, EntropyController
from fastcov.errors import ConfigError
from fastcov.trainer.config.algo import AlgoConfig
from fastcov.trainer.config.base import check as _check
from fastcov.trainer.config.root import Config

# advantage estimators the trainer implements itself (token-level)
TRAINER_ESTIMATORS = ("prime", "optimal_token_baseline")


def _check_registered(cfg: Config) -> None:
    """Import ``trainer.imports`` (where users register their own modes, estimators and reward tasks),
    then check every name against its registry."""
    import importlib

    from fastcov.advantages import ESTIMATORS
    from fastcov.losses import MODES
    from fastcov.trainer.rewards import REWARD_TASKS
    from fastcov.trainer.rollout import ROLLOUT_ENGINES

    for i, module in enumerate(cfg.trainer.imports):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"trainer.imports[{i}]: cannot import {module!r} ({exc})") from None
    a = cfg.algo
    for registry, value, key, extra in ((MODES, a.mode, "algo.mode", ()),
                                        (ESTIMATORS, a.adv_estimator, "algo.adv_estimator", TRAINER_ESTIMATORS),
                                        (REWARD_TASKS, cfg.reward.task, "reward.task", ()),
                                        (ROLLOUT_ENGINES, cfg.rollout.engine, "rollout.engine", ())):
        if value not in registry and value not in extra:
            names = ", ".join(sorted(registry.names() + tuple(extra)))
            near = difflib.get_close_matches(str(value), list(registry.names()) + list(extra), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{key}: unknown {registry.kind} {value!r}{hint}; registered: {names}")
    _check(a.loss.cov_score != "random_matched" or MODES.get(a.mode).selector is not None, "algo.loss.cov_score",
           f"random_matched is a control of a token selection, and algo.mode={a.mode} selects none (clip_cov, kl_cov)")
    _check_trackers(cfg.trainer.report_to)


# trainer.report_to: accelerate's built-in trackers -> what installs each
TRACKER_INSTALL = {"tensorboard": "pip install 'fastcov[tensorboard]'", "wandb": "pip install wandb",
                   "mlflow": "pip install mlflow", "comet_ml": "pip install comet-ml", "aim": "pip install aim",
                   "clearml": "pip install clearml", "dvclive": "pip install dvclive", "swanlab": "pip install swanlab",
                   "trackio": "pip install trackio"}


def _check_trackers(report_to: str | list[str]) -> None:
    """Every trainer.report_to name a tracker accelerate knows (its own, or registered by trainer.imports), and
    installed; after trainer.imports ran."""
    names = [n for n in ([report_to] if isinstance(report_to, str) else report_to) if n not in ("none", "all")]
    if not names:
        return
    try:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
    except ImportError:
        raise ConfigError("trainer.report_to: the trackers need accelerate: pip install 'fastcov[train]'") from None
    installed = {str(t) for t in get_available_trackers()}
    for name in names:
        _check(name in LOGGER_TYPE_TO_CLASS, "trainer.report_to",
               f"unknown tracker {name!r}; accelerate's: {', '.join(TRACKER_INSTALL)}, or one a trainer.imports "
               "module registers (accelerate.tracking.register_tracker_class)")
        _check(name not in TRACKER_INSTALL or name in installed, "trainer.report_to",
               f"{name} is not installed: {TRACKER_INSTALL.get(name)}")


def _validate_entropy_control(a: AlgoConfig) -> None:
    c, e = a.entropy_control, a.entropy_advantage
    _check(e.alpha >= 0, "algo.entropy_advantage.alpha", f"must be >= 0 (0 = off), got {e.alpha}")
    _check(e.kappa > 0, "algo.entropy_advantage.kappa", f"must be > 0, got {e.kappa}")
    _check(e.alpha == 0 or a.adv_estimator != "prime", "algo.entropy_advantage.alpha",
           "shapes sequence-level advantages; PRIME's token-level ones are not supported (set alpha 0)")
    if c.target is None:
        return
    modes = KNOBS[c.knob].modes
    _check(modes is None or a.mode in modes, "algo.entropy_control.knob",
           f"{c.knob} acts only in algo.mode {' / '.join(modes or ())}, not {a.mode}: "
           "it would move a value nothing reads")
    _check(not (c.knob == "pos_weight" and a.pos_weight.enabled), "algo.entropy_control.knob",
           "pos_weight is already scheduled by algo.pos_weight.enabled; use one of the two")
    try:  # the library's own checks, on the controller the loop will build (fastcov.trainer.controls)
        EntropyController.from_config(dataclasses.asdict(c), init=getattr(a.loss, KNOBS[c.knob].loss_field))
    except ArgumentError as exc:
        key = exc.argument if exc.argument in {f.name for f in dataclasses.fields(c)} else "knob"
        raise ConfigError(f"algo.entropy_control.{key}: {exc}") from None


def _validate_across(cfg: Config) -> None:
    """The checks that read more than one section."""
    m, a, r, t = cfg.model, cfg.algo, cfg.rollout, cfg.trainer
    _check(m.quantization == "none" or t.zero_stage < 3, "model.quantization",
           "ZeRO-3 cannot partition 4-bit weights; use trainer.zero_stage 0-2")
    _check(m.lora_rank == 0 or r.engine != "vllm" or r.vllm_mode == "colocated",
           "model.lora_rank", "LoRA syncs its adapters to a colocated vLLM or the HF engine; vLLM servers take full "
           "weights (set rollout.vllm_mode=colocated or rollout.engine=hf)")
    _check(not t.offload_activations or m.gradient_checkpointing, "trainer.offload_activations",
           "offloads gradient checkpointing's saved activations: set model.gradient_checkpointing=true")
    _check(a.mini_batches <= t.prompts_per_step, "algo.mini_batches", "must be <= trainer.prompts_per_step")
    _check(t.prompts_per_step % a.mini_batches == 0, "algo.mini_batches",
           f"{a.mini_batches} does not divide trainer.prompts_per_step={t.prompts_per_step}; pick a divisor "
           "so every mini-batch holds the same number of prompts")
    if a.adv_estimator in ("grpo", "dr_grpo", "rloo", "prime"):
        _check(r.n >= 2, "rollout.n", f"{a.adv_estimator} needs >= 2 rollouts per prompt")
    if r.async_mode != "off":
        _check(m.quantization == "none", "model.quantization",
               "an asynchronous run's engine holds its own copy of the policy, which has no 4-bit form; use "
               "model.quantization=none or rollout.async=off")
        _check(r.stale != "correct" or _correction_on(cfg), "rollout.stale",
               "correct trains stale batches with the rollout correction's weights: set "
               "algo.rollout_correction.enabled=true (or null), or rollout.stale=drop")
        _check(r.engine_restarts == 0 or t.zero_stage < 3, "rollout.engine_restarts",
               "a restarted engine is filled from this rank's full weights, which ZeRO-3 partitions: "
               "set 0 or trainer.zero_stage <= 2")


def _correction_on(cfg: Config) -> bool:
    return cfg.algo.rollout_correction.is_on(cfg.rollout.engine, cfg.rollout.async_mode)


def validate(cfg: Config) -> Config:
    """Range checks that types cannot express: each section's own (its ``validate()``, next to its fields),
    then those across sections; raises ConfigError naming the key."""
    _check_registered(cfg)
    for section in (cfg.model, cfg.data, cfg.rollout, cfg.reward, cfg.algo, cfg.optim, cfg.trainer):
        section.validate()
    _validate_across(cfg)
    _validate_entropy_control(cfg.algo)
    _validate_rollout_correction(cfg)
    return cfg


# modes outside the PPO-clip family (fastcov/policy_modes.py): what does not apply to them
SELECTION_FREE_MODES = ("cispo", "gspo", "sapo", "cispo_seq", "sapo_seq", "vespo")


def _validate_rollout_correction(cfg: Config) -> None:
    rc, a = cfg.algo.rollout_correction, cfg.algo
    _check(rc.clip_max > 0, "algo.rollout_correction.clip_max", f"must be a ratio > 0, got {rc.clip_max}")
    _check(rc.clip_min is None or 0 < rc.clip_min <= rc.clip_max, "algo.rollout_correction.clip_min",
           f"must be in (0, clip_max], got {rc.clip_min}")
    _check((rc.rejection is None) == (rc.rejection_threshold is None), "algo.rollout_correction.rejection_threshold",
           "set both rejection and rejection_threshold, or neither")
    if rc.rejection is not None:
        import torch

        from fastcov.correction import rollout_rejection

        try:  # the library's own parser, on a one-token batch
            rollout_rejection(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), rc.rejection,
                              rc.rejection_threshold)
        except (ValueError, TypeError) as exc:
            key = "rejection" if "criteria" in str(exc) else "rejection_threshold"
            raise ConfigError(f"algo.rollout_correction.{key}: {exc}") from None
    _check(rc.off_policy_mask_threshold is None or rc.off_policy_mask_threshold >= 0,
           "algo.rollout_correction.off_policy_mask_threshold", "must be >= 0")
    _check(not rc.bypass or _correction_on(cfg), "algo.rollout_correction.bypass",
           "takes the PPO ratio against the rollout's log-probs, part of the rollout correction: set "
           "algo.rollout_correction.enabled=true")
    if a.mode in SELECTION_FREE_MODES and a.mode != "gspo":  # GSPO's loss is PPO's clip (of the sequence ratio)
        _check(a.loss.dual_clip_c is None, "algo.loss.dual_clip_c",
               f"the dual clip bounds PPO's clipped loss for A < 0; algo.mode={a.mode} has no such loss (set null)")

