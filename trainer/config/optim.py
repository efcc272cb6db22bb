"""The ``optim`` section: AdamW and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fastcov.trainer.config.base import check as _check


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Literal["constant", "warmup", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        o = self
        _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
        _check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(all(0 <= b < 1 for b in o.betas), "optim.betas", "must be in [0, 1)")
        _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        _check(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables)")

