"""What the loop builds from the run's config and moves from step to step beside the policy: the loss settings of
one update, Jin et al.'s λ schedule (``algo.pos_weight``), the target-entropy controller (``algo.entropy_control``),
Cheng et al.'s entropy-based advantage shaping (``algo.entropy_advantage``), the warning that KL-Cov does nothing
on-policy, and whether the rollout correction is on. The config describes; these are the values a step uses.

The loop (trainer/train.py) asks twice a step: ``step_loss_config(run)`` before the update (step 5), and
``after_step(run, entropy)`` once the step's rollout entropy is known (after step 7); step 4 shapes the advantages
(``shape_advantages``). With none of the three sections set (the default) nothing here changes a number.

Timing (the controller as Jin et al.'s λ schedule): step k's update uses the value each holds at step k; after the
update, each takes step k's rollout entropy H_k (the pre-update policy's mean entropy per response token over all
ranks, the ``entropy`` metric) and moves the value for step k + 1.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Protocol

import torch

from fastcov.advantages import entropy_advantage
from fastcov.entropy_control import KNOBS, EntropyController, controlled
from fastcov.losses import LossConfig
from fastcov.schedules import PositiveWeightSchedule
from fastcov.trainer.config import AlgoConfig, Config, positive_weight_schedule
from fastcov.trainer.runtime.distributed import all_sum


@dataclasses.dataclass
class Controls:
    """The run's controls that move between steps, each None when off: Jin et al.'s λ schedule and the
    target-entropy controller. Checkpointed with the run (``state_dict``: trainer_state.json's "lambda" and
    "entropy_control")."""

    lam: PositiveWeightSchedule | None = None
    entropy: EntropyController | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"lambda": self.lam.state_dict() if self.lam is not None else None,
                **({"entropy_control": self.entropy.state_dict()} if self.entropy is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.lam is not None:
            self.lam.load_state_dict(state["lambda"])
        if self.entropy is not None:
            self.entropy.load_state_dict(state["entropy_control"])


class Run(Protocol):
    """What the controls read of the loop's ``Run`` (trainer/start.py, which imports this module)."""

    cfg: Config
    controls: Controls


def start_controls(a: AlgoConfig, rank: int) -> Controls:
    """At the start of a run: warn (rank 0, once) about on-policy KL-Cov; the run's λ schedule and controller."""
    message = kl_cov_on_policy_message(a)
    if message is not None and rank == 0:
        warnings.warn(message, stacklevel=2)
    return Controls(positive_weight_schedule(a) if a.pos_weight.enabled else None, entropy_controller(a))


def step_loss_config(run: Run) -> LossConfig:
    """The LossConfig of this step's update: ``algo.loss`` with λ from its schedule (``algo.loss.pos_adv_weight``
    without one) and the controlled knob at the controller's applied value."""
    c = run.controls
    lam = c.lam.value if c.lam is not None else run.cfg.algo.loss.pos_adv_weight
    return controlled(loss_config(run.cfg.algo, pos_adv_weight=lam), c.entropy)


def after_step(run: Run, entropy: float) -> dict[str, float]:
    """Move λ and the controller by this step's rollout entropy; returns the controller's metrics: the value this
    step used (``entropy_control/value``), the target it was compared with and the error (target − H)."""
    c, out = run.controls, {}
    if c.lam is not None:
        c.lam.step(entropy=entropy)
    if c.entropy is not None:
        out["entropy_control/value"] = c.entropy.applied
        c.entropy.update(entropy)
        if c.entropy.last_target is not None:  # None while a relative target waits for its window
            out["entropy_control/target"] = c.entropy.last_target
            out["entropy_control/error"] = c.entropy.last_target - entropy
    return out


def shape_advantages(seqs, a: AlgoConfig, device: torch.device | None = None) -> dict[str, float]:
    """Cheng et al.'s A_t ← A_t + min(α·H_t, |A_t|/κ) on every sequence, H_t its rollout-time entropy (``old_entropy``,
    the policy before the update: the current policy of the first mini-batch). Sets ``token_advantages``.

    Returns ``{"entropy_advantage/bonus": mean bonus per response token}``, over all ranks when ``device`` is given
    (then every rank must call it), else over ``seqs``."""
    e = a.entropy_advantage
    bonus = tokens = 0.0
    for s in seqs:
        if not s.response:
            continue
        if s.old_entropy is None:
            raise ValueError("shape_advantages: sequences need old_entropy (compute_old_logprobs(keep_entropy=True))")
        adv = torch.tensor(s.token_advantages if s.token_advantages is not None else [s.advantage] * len(s.response),
                           dtype=torch.float32)
        shaped = entropy_advantage(adv[None], torch.tensor(s.old_entropy, dtype=torch.float32)[None],
                                   alpha=e.alpha, kappa=e.kappa)[0]
        bonus += float((shaped - adv).sum())
        tokens += len(s.response)
        s.token_advantages = shaped.tolist()
    if device is not None:
        bonus, tokens = all_sum([bonus, tokens], device)
    return {"entropy_advantage/bonus": bonus / max(tokens, 1)}


def kl_cov_on_policy_message(a: AlgoConfig) -> str | None:
    """One line when KL-Cov can do nothing: one mini-batch and one PPO epoch update the rollout policy itself, so
    log π − log π_old = 0 on every token and the penalty β·|log ratio| is 0 (PRIME-RL/Entropy-Mechanism-of-RL#1)."""
    if a.mode != "kl_cov" or a.mini_batches != 1 or a.ppo_epochs != 1:
        return None
    return ("algo.mode=kl_cov with algo.mini_batches=1 and algo.ppo_epochs=1: every update starts from the rollout "
            "policy, so KL-Cov's penalty beta*|log ratio| is 0 and KL-Cov trains as plain unclipped policy gradient; "
            "set algo.mini_batches > 1 or algo.ppo_epochs > 1 for the penalty to act")


def loss_config(a: AlgoConfig, pos_adv_weight: float) -> LossConfig:
    """The LossConfig of an update with λ, the weight of tokens with A > 0, given: ``algo.loss`` with
    ``pos_adv_weight`` replaced."""
    return dataclasses.replace(a.loss, pos_adv_weight=pos_adv_weight)


def entropy_controller(a: AlgoConfig) -> EntropyController | None:
    """The EntropyController ``algo.entropy_control`` describes (its ``init`` null: the value ``algo.loss`` holds for
    the knob), or None when its target is null."""
    c = a.entropy_control
    if c.target is None:
        return None
    return EntropyController.from_config(dataclasses.asdict(c), init=getattr(a.loss, KNOBS[c.knob].loss_field))


def rollout_correction_enabled(cfg: Config) -> bool:
    """Whether the run corrects for its rollout engine: algo.rollout_correction.enabled, or by default with vLLM
    and with asynchronous rollouts (whose samples come from older weights)."""
    return cfg.algo.rollout_correction.is_on(cfg.rollout.engine, cfg.rollout.async_mode)
