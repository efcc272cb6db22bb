"""The entropy sections of ``algo``: the target-entropy controller (``algo.entropy_control``), Cheng et al.'s
advantage shaping (``algo.entropy_advantage``) and Jin et al.'s λ schedule (``algo.pos_weight``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fastcov.errors import ConfigError
from fastcov.trainer.config.base import without_name

if TYPE_CHECKING:
    from fastcov.schedules import PositiveWeightSchedule


@dataclass
class EntropyControlConfig:
    """A target-entropy controller (fastcov.entropy_control.EntropyController; docs/trainer.md, "Entropy held
    at a target"): after every step it moves one knob so the rollout entropy goes to ``target``."""

    # nats per response token of the rollout batch, measured over all ranks, or a fraction of the mean entropy of
    # the first `window` steps written "0.75x" (the knob stays at init during them); null = off
    target: float | str | None = None
    # the value it moves: entropy_coef, kl_cov_coef / kl_cov_ratio (algo.mode kl_cov), clip_cov_ratio (clip_cov),
    # pos_weight (Jin et al.'s lambda on tokens with A > 0; EntroPIC's knob)
    knob: Literal["entropy_coef", "kl_cov_coef", "kl_cov_ratio", "clip_cov_ratio", "pos_weight"] = "entropy_coef"
    # step: +-delta per step, clipped (Skywork-OR1, TRL); proportional: value * exp(gain * (target - H) / target);
    # pi: init + s * (kp * e + ki * sum e), e = (target - H) / target, |sum e| <= integral_max (EntroPIC)
    rule: Literal["step", "proportional", "pi"] = "step"
    # the knob's value at step 1 (the pi rule's operating point); null: the algo value it replaces (pos_weight:
    # algo.loss.pos_adv_weight)
    init: float | None = None
    delta: float | None = None  # step rule: change per step (required)
    gain: float = 0.5  # proportional rule
    kp: float | None = None  # pi rule: proportional gain, knob units per unit of relative error (required, >= 0)
    ki: float | None = None  # pi rule: integral gain (required, >= 0; 0: the proportional term alone)
    integral_max: float | None = None  # pi rule: anti-windup bound on |sum e|; null: (max - min) / ki
    # bounds; null: the knob's range (entropy_coef [0, 1], kl_cov_coef [0, 100], ratios [1e-5, 1], pos_weight [0, 1])
    min: float | None = None
    max: float | None = None
    # apply the knob only while the last step's entropy is low (TRL's "bonus only while H <= target"), else its
    # off value (0; pos_weight 1)
    gate: bool = False
    inclusive: bool = False  # H == target counts as low (TRL: true; Skywork-OR1, Jin et al.: false)
    window: int | None = None  # steps whose mean entropy a relative target ("0.75x") multiplies; null: 5
    # a schedule: the target moves linearly from `target` at step target_steps[0] to `target_end` (nats or "0.5x")
    # at step target_steps[1], and stays there
    target_end: float | str | None = None
    target_steps: tuple[int, int] | None = None


@dataclass
class EntropyAdvantageConfig:
    """Cheng et al. 2025 (arXiv 2506.14758): A_t <- A_t + min(alpha * H_t, |A_t| / kappa), H_t the rollout policy's
    token entropy (fastcov.advantages.entropy_advantage). alpha 0 = off."""

    alpha: float = 0.0
    kappa: float = 2.0


@dataclass
class PosWeightConfig:
    """Jin et al. 2025 ("Revisiting Entropy in RL for Large Reasoning Models"): the loss of tokens with A > 0 is
    multiplied by lambda. Off: lambda = algo.loss.pos_adv_weight. On: lambda follows
    fastcov.schedules.PositiveWeightSchedule, stepped once per training step (docs/papers.md):
      entropy (the paper's): lambda starts at init (0) and after each step moves by -delta when the rollout entropy
        H < target_entropy (delta 0.2), +delta otherwise (Delta 0.05), clipped to [0, 1];
      stage: stages [[step, lambda], ...] (first at step 0); epoch: values, one per steps_per_epoch steps;
      constant: init forever."""

    enabled: bool = False
    kind: Literal["entropy", "stage", "epoch", "constant"] = "entropy"
    init: float = 0.0
    target_entropy: float = 0.2
    delta: float = 0.05
    stages: list[tuple[int, float]] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    steps_per_epoch: int = 0

    def schedule_args(self) -> dict[str, tuple[str, Any, Any]]:
        """PositiveWeightSchedule's keyword arguments for this kind: argument -> (this section's key, the value,
        a value the schedule always accepts)."""
        if self.kind == "entropy":
            return {"init": ("init", self.init, 0.0), "threshold": ("target_entropy", self.target_entropy, 0.2),
                    "step_size": ("delta", self.delta, 0.05)}
        if self.kind == "constant":
            return {"init": ("init", self.init, 1.0)}
        if self.kind == "stage":
            return {"stages": ("stages", self.stages, [(0, 1.0)])}
        return {"values": ("values", self.values, [1.0]),
                "steps_per_epoch": ("steps_per_epoch", self.steps_per_epoch or None, 1)}

    def schedule(self) -> PositiveWeightSchedule:
        """The lambda schedule this section describes (fastcov.schedules.PositiveWeightSchedule)."""
        from fastcov.schedules import PositiveWeightSchedule

        return PositiveWeightSchedule(self.kind, **{arg: v[1] for arg, v in self.schedule_args().items()})

    def validate(self, prefix: str = "algo.pos_weight") -> None:
        """When enabled, the schedule must build; a refusal names the key whose value alone the schedule
        refuses (the others set to values it accepts) with the schedule's reason, else the first key of the kind."""
        if not self.enabled:
            return
        try:
            self.schedule()
        except ValueError as exc:
            from fastcov.schedules import PositiveWeightSchedule

            args = self.schedule_args()
            key, why = next(iter(args.values()))[0], str(exc)
            for arg, (name, _, _) in args.items():
                try:
                    PositiveWeightSchedule(self.kind, **{a: (v[1] if a == arg else v[2]) for a, v in args.items()})
                except ValueError as alone:
                    key, why = name, without_name(alone, arg)
                    break
            raise ConfigError(f"{prefix}.{key}: {why}") from None
