"""``algo.rollout_correction``: importance weights, rejection and the off-policy mask for a sampler that is not the
policy (another engine, older weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class RolloutCorrectionConfig:
    """algo.rollout_correction: importance weights π_old/π_rollout on the loss of every mode, rejection and the
    off-policy sequence mask (fastcov/correction.py; verl's algorithm.rollout_correction, TRL's
    vllm_importance_sampling_*; docs/trainer.md, "Rollout correction")."""

    # null: on with a vLLM rollout (another sampler than the policy), off with the built-in HF engine (it samples
    # from the policy itself: the weights would be 1 up to rounding)
    enabled: bool | None = None
    level: Literal["token", "sequence"] = "token"  # verl's rollout_is; TRL's token_* / sequence_*
    mode: Literal["truncate", "mask"] = "truncate"  # clamp (TIS) or zero (IcePop) outside [clip_min, clip_max]
    clip_max: float = 2.0
    clip_min: float | None = None
    # verl's rollout_rs / rollout_rs_threshold: "token_k1,seq_mean_k3" with "0.5_2.0,0.01" (null: no rejection)
    rejection: str | None = None
    rejection_threshold: str | float | None = None
    # TRL's off_policy_mask_threshold (DeepSeek-V3.2): drop the A < 0 tokens of sequences whose mean KL > this
    off_policy_mask_threshold: float | None = None
    # verl's bypass mode: the PPO ratio is taken against the rollout's own log-probs (pi / pi_rollout, two policies)
    # and the importance weights are left out (the ratio holds them); rejection and the off-policy mask still act.
    # false: verl's decoupled mode, AReaL's decoupled PPO (pi / pi_old clipped, times the weight pi_old / pi_rollout).
    bypass: bool = False

    def is_on(self, engine: str, async_mode: str) -> bool:
        """``enabled`` resolved for a run with rollout.engine ``engine`` and rollout.async ``async_mode``: null is on
        with another engine than the built-in HF one (another sampler than the policy) and with asynchronous
        rollouts (samples from older weights)."""
        return (engine != "hf" or async_mode != "off") if self.enabled is None else self.enabled
