"""Run configuration: YAML files onto typed dataclasses, dotlist overrides, validation.

    cfg = load_config("configs/demo.yaml", ["algo.mode=kl_cov", "trainer.max_steps=50"])

Every key is checked: an unknown key (with the nearest known one suggested), a value of the wrong type,
a non-finite float (``.inf``, ``.nan``) or a value outside its allowed range raises ``ConfigError`` naming
the dotted key (``algo.mdoe``, ``optim.lr``); a YAML syntax error names the file, line and column. The
resolved config is written to the run directory as ``config.yaml`` by the trainer.

One module per section, each dataclass beside the checks of its own fields: ``model``, ``data``, ``rollout``,
``reward``, ``algo`` (its loss is ``fastcov.losses.LossConfig`` itself, nested as ``algo.loss``; ``correction`` and
``entropy`` hold its sub-sections), ``optim``, ``trainer``; ``root`` (``Config``), ``load`` (YAML, overrides,
coercion, moved keys), ``checks`` (registries, trackers, the rules across sections). What a run builds from its
config (the loss settings of a step, the entropy controller) is the loop's: ``fastcov.trainer.controls``.
"""

from __future__ import annotations

import dataclasses

from fastcov._moved import moved_attribute
from fastcov.errors import ConfigError, UserError
from fastcov.trainer.config.algo import AlgoConfig, PrimeConfig, positive_weight_schedule
from fastcov.trainer.config.base import config_key
from fastcov.trainer.config.checks import SELECTION_FREE_MODES, TRACKER_INSTALL, TRAINER_ESTIMATORS, validate
from fastcov.trainer.config.correction import RolloutCorrectionConfig
from fastcov.trainer.config.data import DataConfig, SyntheticConfig
from fastcov.trainer.config.entropy import EntropyAdvantageConfig, EntropyControlConfig, PosWeightConfig
from fastcov.trainer.config.load import MOVED_KEYS, apply_overrides, config_from_dict, load_config
from fastcov.trainer.config.model import LORA_TARGETS, ModelConfig
from fastcov.trainer.config.optim import OptimConfig
from fastcov.trainer.config.reward import CodeRewardConfig, RewardConfig
from fastcov.trainer.config.rollout import RolloutConfig
from fastcov.trainer.config.root import Config
from fastcov.trainer.config.trainer import TrainerConfig

__all__ = ["LORA_TARGETS", "MOVED_KEYS", "SELECTION_FREE_MODES", "TRACKER_INSTALL", "TRAINER_ESTIMATORS",
           "AlgoConfig", "CodeRewardConfig", "Config", "ConfigError", "DataConfig", "EntropyAdvantageConfig",
           "EntropyControlConfig", "ModelConfig", "OptimConfig", "PosWeightConfig", "PrimeConfig", "RewardConfig",
           "RolloutConfig", "RolloutCorrectionConfig", "SyntheticConfig", "TrainerConfig", "UserError",
           "apply_overrides", "config_from_dict", "config_key", "load_config", "positive_weight_schedule",
           "validate"]

# the run-time builders moved to the loop (after 0.5.0): still found here, with a one-line FutureWarning
_MOVED = {"loss_config": "fastcov.trainer.controls", "entropy_controller": "fastcov.trainer.controls",
          "rollout_correction_enabled": "fastcov.trainer.controls"}


def __getattr__(name: str) -> object:
    if name == "LOSS_FIELDS":  # after 0.5.0, algo.loss is fastcov.losses.LossConfig itself
        import warnings

        from fastcov.losses import LossConfig

        warnings.warn("fastcov.trainer.config.LOSS_FIELDS is deprecated: algo.loss is fastcov.losses.LossConfig, "
                      "whose fields are dataclasses.fields(LossConfig)", FutureWarning, stacklevel=2)
        return tuple(f.name for f in dataclasses.fields(LossConfig) if f.name not in ("loss_scale_factor",
                                                                                          "check_finite"))
    return moved_attribute(__name__, name, _MOVED)
