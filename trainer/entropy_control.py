"""The training loop's entropy controls beyond the loss: the target-entropy controller (``algo.entropy_control``),
Cheng et al.'s entropy-based advantage shaping (``algo.entropy_advantage``) and the warning that KL-Cov does
nothing on-policy. train.py calls these at four points; with neither section set (the default) none of them
changes a number.

Timing of the controller (as Jin et al.'s λ schedule): step k's update uses the value the controller holds at
step k; after the update, the controller takes step k's rollout entropy H_k (the pre-update policy's mean
entropy per response token over all ranks, the ``entropy`` metric) and moves the value for step k + 1.
"""

from __future__ import annotations

import warnings

import torch

from fastcov.advantages import entropy_advantage
from fastcov.entropy_control import EntropyController
from fastcov.entropy_control import controlled as controlled_loss_config
from fastcov.losses import LossConfig
from fastcov.trainer.config import AlgoConfig
from fastcov.trainer.controls import entropy_controller
from fastcov.trainer.runtime.distributed import all_sum


def kl_cov_on_policy_message(a: AlgoConfig) -> str | None:
    """One line when KL-Cov can do nothing: one mini-batch and one PPO epoch update the rollout policy itself, so
    log π − log π_old = 0 on every token and the penalty β·|log ratio| is 0 (PRIME-RL/Entropy-Mechanism-of-RL#1)."""
    if a.mode != "kl_cov" or a.mini_batches != 1 or a.ppo_epochs != 1:
        return None
    return ("algo.mode=kl_cov with algo.mini_batches=1 and algo.ppo_epochs=1: every update starts from the rollout "
            "policy, so KL-Cov's penalty beta*|log ratio| is 0 and KL-Cov trains as plain unclipped policy gradient; "
            "set algo.mini_batches > 1 or algo.ppo_epochs > 1 for the penalty to act")


def start(a: AlgoConfig, rank: int) -> EntropyController | None:
    """At the start of a run: warn (rank 0, once) about on-policy KL-Cov; the run's controller or None."""
    message = kl_cov_on_policy_message(a)
    if message is not None and rank == 0:
        warnings.warn(message, stacklevel=2)
    return entropy_controller(a)


def controlled(loss_cfg: LossConfig, ctl: EntropyController | None) -> LossConfig:
    """``loss_cfg`` with the controlled knob set to the controller's applied value (unchanged without one)."""
    return controlled_loss_config(loss_cfg, ctl)


def after_step(ctl: EntropyController | None, entropy: float, rec: dict) -> None:
    """Log the value step ``rec`` used, move the controller by this step's entropy, and log the target it was
    compared with and the error (target − H)."""
    if ctl is None:
        return
    rec["entropy_control/value"] = ctl.applied
    if ctl.knob == "pos_weight":
        rec["lambda"] = ctl.applied  # the λ this step used
    ctl.update(entropy)
    if ctl.last_target is not None:  # None while a relative target waits for its window
        rec["entropy_control/target"] = ctl.last_target
        rec["entropy_control/error"] = ctl.last_target - entropy


def shape_advantages(seqs, a: AlgoConfig, device: torch.device | None = None) -> dict:
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
