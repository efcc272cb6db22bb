"""``Config``: the run's sections, one dataclass each, in the order the YAML files list them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastcov.trainer.config.algo import AlgoConfig
from fastcov.trainer.config.base import to_plain
from fastcov.trainer.config.data import DataConfig
from fastcov.trainer.config.model import ModelConfig
from fastcov.trainer.config.optim import OptimConfig
from fastcov.trainer.config.reward import RewardConfig
from fastcov.trainer.config.rollout import RolloutConfig
from fastcov.trainer.config.trainer import TrainerConfig


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML data (sections as mappings, tuples as lists), under its YAML keys."""
        return to_plain(self)
