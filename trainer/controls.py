"""What the loop builds from the run's config: the loss settings of one update, the target-entropy controller,
whether the rollout correction is on. The config describes; these are the values a step uses."""

from __future__ import annotations

import dataclasses

from fastcov.entropy_control import KNOBS, EntropyController
from fastcov.losses import LossConfig
from fastcov.trainer.config import AlgoConfig, Config


def loss_config(a: AlgoConfig, pos_adv_weight: float) -> LossConfig:
    """The LossConfig of one update: ``algo.loss`` with λ, the weight of tokens with A > 0, from its schedule."""
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
