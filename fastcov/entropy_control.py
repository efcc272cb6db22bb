"""A target-entropy controller: one feedback rule that moves any entropy knob toward a target entropy.

fastcov's entropy controls are knobs (the entropy bonus, KL-Cov's β and ratio, Clip-Cov's ratio, Jin et al.'s
positive-advantage weight λ). A value that holds entropy on one model and task collapses or inflates it on
another; this controller measures the policy entropy H after every update and moves the knob so that H goes
to ``target``.

Knobs and the direction that raises entropy (``KNOBS``)::

    entropy_coef    the entropy bonus coefficient       up raises H     neutral value 0
    kl_cov_coef     KL-Cov's β                          up raises H     neutral value 0
    kl_cov_ratio    KL-Cov's fraction of tokens         up raises H     (no neutral value)
    clip_cov_ratio  Clip-Cov's fraction of tokens       up raises H     (no neutral value)
    pos_weight      λ on tokens with A > 0 (Jin et al.)  down raises H  neutral value 1

Rules (``"low"`` means H < target, or H ≤ target with ``inclusive=True``)::

    step          v ← clip(v ± delta, min, max): one delta toward raising H when low, one delta the
                  other way otherwise. Skywork-OR1's adaptive entropy (entropy_coef, delta 1e-4, [0, 0.005]),
                  TRL's ``use_adaptive_entropy`` (entropy_coef, delta 0.005, [0, 1], ``inclusive=True``,
                  ``gate=True``) and Jin et al.'s λ schedule (pos_weight, delta 0.05, [0, 1]) are this rule.
    proportional  v ← clip(v · exp(s · gain · (target − H) / target), min, max), s = +1 for knobs that raise
                  H upward, −1 for pos_weight: a step in log space proportional to the relative error, so the
                  knob moves fast when H is far from the target and settles without the ±delta limit cycle.
                  It scales the knob, so it needs ``min > 0`` and ``target > 0``.

``gate=True`` (TRL's behaviour) applies the knob only while the entropy measured at the last update is at or
below the target (``inclusive``) or below it, and the knob's neutral value otherwise (no bonus), and before
the first measurement. The controller's own value keeps moving either way.

Use (any training loop)::

    ctl = EntropyController(target=0.3, knob="entropy_coef", init=0.0, delta=1e-4, max=5e-3)
    for step in range(n_steps):
        coef = ctl.applied          # the knob's value for this update
        ... update the policy with coef, measure the rollout entropy over all ranks ...
        H = all_rank_entropy(entropy_sum, token_count, group)   # nats per response token
        ctl.update(H)               # -> the value for the next update

``state_dict()`` / ``load_state_dict()`` are plain Python scalars (JSON-safe): a resumed run continues with
bit-identical values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["EntropyController", "KNOBS", "LOSS_FIELDS", "RULES", "Knob", "all_rank_entropy", "controlled"]

RULES = ("step", "proportional")


@dataclass(frozen=True)
class Knob:
    """What the controller knows about a knob: ``direction`` +1 if raising it raises the entropy, −1 if
    lowering it does; ``neutral``: the value that turns it off (None: it has none, ``gate`` is refused);
    ``low``/``high``: the range of values it accepts (``low_open``: ``low`` excluded); ``default_min`` /
    ``default_max``: the bounds when none are given (None: ``low`` / ``high``)."""

    direction: int
    neutral: float | None
    low: float
    high: float
    low_open: bool = False
    default_min: float | None = None
    default_max: float | None = None


KNOBS: dict[str, Knob] = {
    "entropy_coef": Knob(+1, 0.0, 0.0, math.inf, default_max=1.0),
    "kl_cov_coef": Knob(+1, 0.0, 0.0, math.inf, default_max=100.0),
    "kl_cov_ratio": Knob(+1, None, 0.0, 1.0, low_open=True, default_min=1e-5),
    "clip_cov_ratio": Knob(+1, None, 0.0, 1.0, low_open=True, default_min=1e-5),
    "pos_weight": Knob(-1, 1.0, 0.0, 1.0),
}
# the fastcov.losses.LossConfig field each knob sets
LOSS_FIELDS = {"entropy_coef": "entropy_coef", "kl_cov_coef": "kl_cov_coef", "kl_cov_ratio": "kl_cov_ratio",
               "clip_cov_ratio": "clip_cov_ratio", "pos_weight": "pos_adv_weight"}
_CONFIG_KEYS = ("target", "knob", "rule", "init", "delta", "gain", "min", "max", "gate", "inclusive")


class ArgumentError(ValueError):
    """A bad argument of ``EntropyController``, in one line; ``argument`` names it ("target", "delta", ...; "config"
    for an unknown key of ``from_config``)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(name, f"{name} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ArgumentError(name, f"{name} must be finite, got {value!r}")
    return out


class EntropyController:
    """Moves one knob toward the value that holds the policy entropy at ``target`` (module docstring).

    Args:
        target: the entropy to hold, nats per response token (> 0 for ``rule="proportional"``).
        knob: a name in ``KNOBS``.
        init: the knob's value before the first update (inside [min, max]).
        rule: ``"step"`` or ``"proportional"``.
        delta: the step rule's change per update (>= 0; required by ``"step"``).
        gain: the proportional rule's gain (> 0; default 0.5).
        min: lower bound of the value (default: the knob's range; the ratios' lower bound 1e-5).
        max: upper bound of the value (default: the knob's range).
        gate: apply the knob's neutral value unless the last measured entropy is low (TRL's rule).
        inclusive: H == target counts as low (TRL: True; Skywork-OR1 and Jin et al.: False).

    Raises:
        ArgumentError: a ValueError, one line naming the offending argument, which its ``argument`` holds.
    """

    def __init__(self, target: float, knob: str, init: float, *, rule: str = "step", delta: float | None = None,
                 gain: float = 0.5, min: float | None = None, max: float | None = None,
                 gate: bool = False, inclusive: bool = False) -> None:
        if knob not in KNOBS:
            raise ArgumentError("knob", f"knob must be one of {', '.join(KNOBS)}, got {knob!r}")
        if rule not in RULES:
            raise ArgumentError("rule", f"rule must be one of {', '.join(RULES)}, got {rule!r}")
        spec = KNOBS[knob]
        self.knob, self.rule, self.spec = knob, rule, spec
        self.target = _number(target, "target")
        if self.target < 0 or (rule == "proportional" and self.target == 0):
            raise ArgumentError("target", f"target must be {'> 0' if rule == 'proportional' else '>= 0'} nats, "
                                          f"got {target!r}")
        default_min = spec.low if spec.default_min is None else spec.default_min
        self.min = default_min if min is None else _number(min, "min")
        self.max = (spec.high if spec.default_max is None else spec.default_max) if max is None else _number(max, "max")
        domain = f"{'(' if spec.low_open else '['}{spec.low:g}, {spec.high:g}] for knob {knob}"
        for name, bound in (("min", self.min), ("max", self.max)):
            if not (bound > spec.low if spec.low_open else bound >= spec.low) or bound > spec.high:
                raise ArgumentError(name, f"{name} must lie in {domain}, got {bound:g}")
        if self.min > self.max:
            raise ArgumentError("min", f"min must be <= max, got min={self.min:g}, max={self.max:g}")
        if rule == "proportional" and self.min <= 0:
            raise ArgumentError("min", "min must be > 0 with rule proportional (it scales the knob), "
                                       f"got {self.min:g}")
        self.delta = None if delta is None else _number(delta, "delta")
        if rule == "step" and (self.delta is None or self.delta < 0):
            raise ArgumentError("delta", f"delta must be a number >= 0 with rule step, got {delta!r}")
        self.gain = _number(gain, "gain")
        if self.gain <= 0:
            raise ArgumentError("gain", f"gain must be > 0, got {gain!r}")
        if not isinstance(gate, bool) or not isinstance(inclusive, bool):
            raise ArgumentError("gate" if not isinstance(gate, bool) else "inclusive",
                                f"gate and inclusive must be true or false, got gate={gate!r}, inclusive={inclusive!r}")
        if gate and spec.neutral is None:
            raise ArgumentError("gate", "gate needs a knob with an off value (entropy_coef, kl_cov_coef, pos_weight), "
                                        f"not {knob}")
        self.gate, self.inclusive = gate, inclusive
        self.init = _number(init, "init")
        if not self.min <= self.init <= self.max:
            raise ArgumentError("init", f"init must lie in [min, max] = [{self.min:g}, {self.max:g}], "
                                        f"got {self.init:g}")
        self.value = self.init
        self.last_entropy: float | None = None
        self.updates = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: Mapping[str, Any], init: float | None = None) -> EntropyController:
        """Build from a mapping with the keys of ``algo.entropy_control`` (``target``, ``knob``, ``rule``,
        ``init``, ``delta``, ``gain``, ``min``, ``max``, ``gate``, ``inclusive``); ``init`` is used when the
        mapping has none (or None). Unknown keys raise ArgumentError (a ValueError) naming them."""
        for key in config:
            if key not in _CONFIG_KEYS:
                raise ArgumentError("config", f"unknown entropy-control key {key!r}; known keys: "
                                              f"{', '.join(_CONFIG_KEYS)}")
        kwargs = {k: v for k, v in config.items() if v is not None and k not in ("target", "knob", "init")}
        start = config.get("init")
        start = init if start is None else start
        if start is None:
            raise ArgumentError("init", "init is required (the knob's value before the first update)")
        if config.get("target") is None:
            raise ArgumentError("target", "target is required (nats per response token)")
        return cls(config["target"], config.get("knob", "entropy_coef"), start, **kwargs)

    # ------------------------------------------------------------------ the rule
    def is_low(self, entropy: float) -> bool:
        """Whether ``entropy`` is below the target (at or below it with ``inclusive``)."""
        return entropy <= self.target if self.inclusive else entropy < self.target

    @property
    def applied(self) -> float:
        """The knob's value for the next update: ``value``, or the neutral value while ``gate`` holds it off."""
        if self.gate and (self.last_entropy is None or not self.is_low(self.last_entropy)):
            assert self.spec.neutral is not None  # __init__ refuses gate on knobs without one
            return self.spec.neutral
        return self.value

    @property
    def error(self) -> float | None:
        """target − H at the last update (nats), None before the first."""
        return None if self.last_entropy is None else self.target - self.last_entropy

    def update(self, entropy: float) -> float:
        """Take the entropy H measured after an update (nats per response token, over all ranks) and move the
        value by the rule; returns the new value.

        Raises:
            ValueError: ``entropy`` not a finite number.
        """
        try:
            h = float(entropy)
        except (TypeError, ValueError):
            raise ValueError(f"entropy must be a finite number, got {entropy!r}") from None
        if not math.isfinite(h):
            raise ValueError(f"entropy must be a finite number, got {entropy!r}")
        if self.rule == "step":
            assert self.delta is not None
            # one delta in the direction that raises entropy when it is low, the other way when it is not
            change = self.delta if self.is_low(h) == (self.spec.direction > 0) else -self.delta
            moved = self.value + change
        else:
            moved = self.value * math.exp(self.spec.direction * self.gain * (self.target - h) / self.target)
        self.value = min(self.max, max(self.min, moved))
        self.last_entropy = h
        self.updates += 1
        return self.value

    # ------------------------------------------------------------------ checkpointing and logging
    def config(self) -> dict[str, Any]:
        """The mapping ``from_config`` turns back into this controller (before its first update)."""
        return {"target": self.target, "knob": self.knob, "rule": self.rule, "init": self.init, "delta": self.delta,
                "gain": self.gain, "min": self.min, "max": self.max, "gate": self.gate, "inclusive": self.inclusive}

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: the configuration, the value, the last entropy and the update count."""
        return {"config": self.config(), "value": self.value, "last_entropy": self.last_entropy,
                "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()``; the configuration must match this controller's.

        Raises:
            ValueError: missing keys, another configuration, or a value outside [min, max].
        """
        for key in ("config", "value", "last_entropy", "updates"):
            if key not in state:
                raise ValueError(f"entropy-control state is missing {key!r}")
        if dict(state["config"]) != self.config():
            raise ValueError(f"entropy-control state {dict(state['config'])!r} does not match this run's "
                             f"{self.config()!r}")
        value = _number(state["value"], "value")
        if not self.min <= value <= self.max:
            raise ValueError(f"entropy-control value {value!r} is outside [{self.min:g}, {self.max:g}]")
        last = state["last_entropy"]
        self.value = value
        self.last_entropy = None if last is None else _number(last, "last_entropy")
        self.updates = int(state["updates"])

    def metrics(self) -> dict[str, float]:
        """``entropy_control/value`` (the knob's value now), ``/applied`` (what the next update uses) and
        ``/error`` (target − H at the last update, once there is one)."""
        out = {"entropy_control/value": self.value, "entropy_control/applied": self.applied}
        if self.error is not None:
            out["entropy_control/error"] = self.error
        return out

    def __repr__(self) -> str:
        return f"EntropyController({self.config()!r}, value={self.value:g}, updates={self.updates})"


def controlled(loss_config, controller: EntropyController | None):
    """``loss_config`` (a ``fastcov.losses.LossConfig``) with the controller's knob set to ``controller.applied``;
    ``loss_config`` itself when ``controller`` is None."""
    if controller is None:
        return loss_config
    return dataclasses.replace(loss_config, **{LOSS_FIELDS[controller.knob]: controller.applied})


def all_rank_entropy(entropy_sum: float | torch.Tensor, token_count: float | torch.Tensor, group=None,
                     device: torch.device | str | None = None) -> float:
    """The mean entropy per token over every rank of ``group``: Σ_ranks entropy_sum / Σ_ranks token_count.

    Args:
        entropy_sum: this rank's Σ H_t over its valid response tokens (a number or a 0-dim tensor).
        token_count: this rank's number of valid response tokens.
        group: a ``torch.distributed`` process group; None (or no initialised process group): this process only.
        device: where the all-reduce runs (default: the tensor's device, else CPU; NCCL needs a CUDA device).

    Returns:
        A Python float (nats per token), 0.0 when there is no token anywhere. The sums are reduced in fp64, so
        the result does not depend on how the tokens are split over ranks beyond fp64 rounding.
    """
    like = entropy_sum if isinstance(entropy_sum, torch.Tensor) else None
    dev = torch.device(device) if device is not None else (like.device if like is not None else torch.device("cpu"))
    totals = torch.stack([torch.as_tensor(entropy_sum, dtype=torch.float64, device=dev).reshape(()),
                          torch.as_tensor(token_count, dtype=torch.float64, device=dev).reshape(())])
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    total, count = totals.tolist()
    return total / count if count > 0 else 0.0
