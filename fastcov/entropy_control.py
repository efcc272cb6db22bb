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
    pi            e = (target − H) / target (the relative error), I ← clip(I + e, −integral_max, integral_max),
                  v ← clip(init + s · (kp · e + ki · I), min, max): a proportional-integral controller around
                  the knob's start value (EntroPIC's rule, Yang et al. 2025, arXiv 2511.15248, which drives the
                  positive samples' weight). The integral removes the steady-state error a proportional term alone
                  keeps. Anti-windup: ``integral_max`` bounds |I| (default (max − min) / ki, so the integral term
                  alone cannot leave the range twice over), and I does not grow while v sits at a bound and e
                  pushes it further (conditional integration), so the knob leaves the bound as soon as e turns.
                  It adds to the knob, so it works from 0 (the bonus, β) and needs ``target > 0``.

Targets. ``target`` is nats per response token (``0.25``) or a fraction of the start's entropy (``"0.75x"``:
0.75 × the mean entropy of the first ``window`` steps, default 5, the anchor AER uses, arXiv 2510.10959); during
those steps the knob stays at ``init``, and the rule acts from the window's last step on. ``target_end`` with
``target_steps = (s0, s1)`` makes it a schedule: the target is ``target`` up to step s0, moves linearly to
``target_end`` at step s1 and stays there (either end absolute or relative). Steps count the controller's
updates, from 1.

``gate=True`` (TRL's behaviour) applies the knob only while the entropy measured at the last update is at or
below the target (``inclusive``) or below it, and the knob's neutral value otherwise (no bonus), and before
the first measurement. The controller's own value keeps moving either way.

Use (any training loop)::

    ctl = EntropyController(target=0.3, knob="entropy_coef", init=0.0, delta=1e-4, max=5e-3)
    # or: EntropyController("0.75x", "pos_weight", 1.0, rule="pi", kp=1.0, ki=0.2, window=5)
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["EntropyController", "KNOBS", "LOSS_FIELDS", "RULES", "Knob", "all_rank_entropy", "controlled",
           "parse_target"]

RULES = ("step", "proportional", "pi")


@dataclass(frozen=True)
class Knob:
    """A knob, in ``KNOBS`` (the one table; the trainer's config and the TRL integration read it): ``direction`` +1
    if raising it raises the entropy, −1 if lowering it does; ``neutral``: its off value (None: none, ``gate`` is
    refused); ``low``/``high``: the values it accepts (``low_open``: ``low`` excluded); ``default_min`` /
    ``default_max``: the bounds when none are given (None: ``low`` / ``high``); ``loss_field``: the
    ``fastcov.losses.LossConfig`` field it sets; ``modes``: the loss modes that read it (None: every mode)."""

    direction: int
    neutral: float | None
    low: float
    high: float
    low_open: bool = False
    default_min: float | None = None
    default_max: float | None = None
    loss_field: str = dataclasses.field(kw_only=True)
    modes: tuple[str, ...] | None = dataclasses.field(default=None, kw_only=True)


KNOBS: dict[str, Knob] = {
    "entropy_coef": Knob(+1, 0.0, 0.0, math.inf, default_max=1.0, loss_field="entropy_coef"),
    "kl_cov_coef": Knob(+1, 0.0, 0.0, math.inf, default_max=100.0, loss_field="kl_cov_coef", modes=("kl_cov",)),
    "kl_cov_ratio": Knob(+1, None, 0.0, 1.0, low_open=True, default_min=1e-5, loss_field="kl_cov_ratio",
                         modes=("kl_cov",)),
    "clip_cov_ratio": Knob(+1, None, 0.0, 1.0, low_open=True, default_min=1e-5, loss_field="clip_cov_ratio",
                           modes=("clip_cov",)),
    "pos_weight": Knob(-1, 1.0, 0.0, 1.0, loss_field="pos_adv_weight"),
}
LOSS_FIELDS = {name: knob.loss_field for name, knob in KNOBS.items()}  # the LossConfig field each knob sets
_CONFIG_KEYS = ("target", "knob", "rule", "init", "delta", "gain", "kp", "ki", "integral_max", "min", "max", "gate",
                "inclusive", "window", "target_end", "target_steps")
# the keys added after the first release: a checkpoint written before them holds none, and means these values
_LATER_DEFAULTS = dict.fromkeys(("kp", "ki", "integral_max", "window", "target_end", "target_steps"))
DEFAULT_WINDOW = 5


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


def parse_target(value: Any, name: str = "target") -> tuple[float, bool]:
    """A target as ``(number, relative)``: nats (a number >= 0) -> ``(nats, False)``; a fraction of the start's
    entropy (a string ``"0.75x"``, fraction > 0) -> ``(0.75, True)``.

    Raises:
        ArgumentError: anything else, naming ``name``.
    """
    if isinstance(value, str):
        text = value.strip()
        fraction = None
        if text.endswith("x"):
            try:
                fraction = float(text[:-1])
            except ValueError:
                fraction = None
        if fraction is None or not math.isfinite(fraction) or fraction <= 0:
            raise ArgumentError(name, f"{name} must be nats (a number >= 0) or a fraction > 0 of the start's "
                                      f"entropy written like '0.75x', got {value!r}")
        return fraction, True
    nats = _number(value, name)
    if nats < 0:
        raise ArgumentError(name, f"{name} must be >= 0 nats, got {value!r}")
    return nats, False


def _step_count(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ArgumentError(name, f"{name} must be an integer >= {least}, got {value!r}")
    return value


class EntropyController:
    """Moves one knob toward the value that holds the policy entropy at ``target`` (module docstring).

    Args:
        target: the entropy to hold: nats per response token (a number; > 0 for ``rule="proportional"`` and
            ``"pi"``), or a fraction of the mean entropy of the first ``window`` steps (a string, ``"0.75x"``).
        knob: a name in ``KNOBS``.
        init: the knob's value before the first update (inside [min, max]); the PI rule's operating point.
        rule: ``"step"``, ``"proportional"`` or ``"pi"``.
        delta: the step rule's change per update (>= 0; required by ``"step"``).
        gain: the proportional rule's gain (> 0; default 0.5).
        kp: the PI rule's proportional gain, knob units per unit of relative error (>= 0; required by ``"pi"``).
        ki: the PI rule's integral gain, the same units (>= 0; required by ``"pi"``; 0 leaves the proportional
            term alone, kept for comparison: it holds a steady-state error).
        integral_max: the PI rule's anti-windup bound on |Σ e| (> 0; default (max − min) / ki).
        min: lower bound of the value (default: the knob's range; the ratios' lower bound 1e-5).
        max: upper bound of the value (default: the knob's range).
        gate: apply the knob's neutral value unless the last measured entropy is low (TRL's rule).
        inclusive: H == target counts as low (TRL: True; Skywork-OR1 and Jin et al.: False).
        window: steps whose mean entropy a relative target multiplies (>= 1; default 5; only with one).
        target_end: the target at step ``target_steps[1]`` (nats or ``"0.5x"``); None: a constant target.
        target_steps: ``(s0, s1)``, 0 <= s0 < s1: the target moves linearly from ``target`` at step s0 to
            ``target_end`` at step s1 (required with ``target_end``).

    Raises:
        ArgumentError: a ValueError, one line naming the offending argument, which its ``argument`` holds.
    """

    def __init__(self, target: float | str, knob: str, init: float, *, rule: str = "step",
                 delta: float | None = None, gain: float = 0.5, kp: float | None = None, ki: float | None = None,
                 integral_max: float | None = None, min: float | None = None, max: float | None = None,
                 gate: bool = False, inclusive: bool = False, window: int | None = None,
                 target_end: float | str | None = None, target_steps: Sequence[int] | None = None) -> None:
        if knob not in KNOBS:
            raise ArgumentError("knob", f"knob must be one of {', '.join(KNOBS)}, got {knob!r}")
        if rule not in RULES:
            raise ArgumentError("rule", f"rule must be one of {', '.join(RULES)}, got {rule!r}")
        spec = KNOBS[knob]
        self.knob, self.rule, self.spec = knob, rule, spec
        self._targets = [parse_target(target, "target")]
        self._target_spec: tuple[float | str, float | str | None] = (target, target_end)
        if target_end is not None:
            self._targets.append(parse_target(target_end, "target_end"))
            if target_steps is None:
                raise ArgumentError("target_steps", "target_steps [s0, s1] is required with target_end (the target "
                                                    "moves from target at step s0 to target_end at step s1)")
        if target_steps is not None:
            if target_end is None:
                raise ArgumentError("target_steps", "target_steps needs target_end (the target it moves to)")
            if isinstance(target_steps, (str, bytes)) or len(target_steps) != 2:
                raise ArgumentError("target_steps", f"target_steps must be two steps [s0, s1], got {target_steps!r}")
            s0 = _step_count(target_steps[0], "target_steps", 0)
            s1 = _step_count(target_steps[1], "target_steps", 0)
            if s1 <= s0:
                raise ArgumentError("target_steps", f"target_steps must be [s0, s1] with s0 < s1, got {[s0, s1]}")
            self.target_steps: tuple[int, int] | None = (s0, s1)
        else:
            self.target_steps = None
        if rule in ("proportional", "pi"):
            for name, (number, _) in zip(("target", "target_end"), self._targets, strict=False):
                if number == 0:
                    raise ArgumentError(name, f"{name} must be > 0 with rule {rule} (it divides the error), got 0")
        self.relative = any(rel for _, rel in self._targets)
        if window is not None and not self.relative:
            raise ArgumentError("window", "window applies to a relative target ('0.75x'), and this one is in nats")
        self.window = _step_count(DEFAULT_WINDOW if window is None else window, "window", 1)
        self._window_given = window is not None
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
        self.kp = None if kp is None else _number(kp, "kp")
        self.ki = None if ki is None else _number(ki, "ki")
        self._integral_max_given = None if integral_max is None else _number(integral_max, "integral_max")
        if rule == "pi":
            if self.kp is None or self.kp < 0:
                raise ArgumentError("kp", f"kp must be a number >= 0 with rule pi, got {kp!r}")
            if self.ki is None or self.ki < 0:
                raise ArgumentError("ki", f"ki must be a number >= 0 with rule pi (0: the proportional term alone, "
                                          f"which keeps a steady-state error), got {ki!r}")
            if self._integral_max_given is not None and self._integral_max_given <= 0:
                raise ArgumentError("integral_max", f"integral_max must be > 0, got {integral_max!r}")
        elif (kp, ki, integral_max) != (None, None, None):
            name = "kp" if kp is not None else "ki" if ki is not None else "integral_max"
            raise ArgumentError(name, f"{name} is the pi rule's, not rule {rule}'s")
        self.integral_max: float | None = None
        if rule == "pi":
            assert self.ki is not None
            self.integral_max = (self._integral_max_given if self._integral_max_given is not None
                                 else (self.max - self.min) / self.ki if self.ki > 0 else math.inf)
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
        self.last_target: float | None = None  # the target the last measured entropy was compared with
        self.reference: float | None = None  # the first window's mean entropy (relative targets)
        self.integral = 0.0  # Σ e of the pi rule
        self._window_sum = 0.0
        self.updates = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: Mapping[str, Any], init: float | None = None) -> EntropyController:
        """Build from a mapping with the keys of ``algo.entropy_control`` (``target``, ``knob``, ``rule``,
        ``init``, ``delta``, ``gain``, ``kp``, ``ki``, ``integral_max``, ``min``, ``max``, ``gate``, ``inclusive``,
        ``window``, ``target_end``, ``target_steps``); ``init`` is used when the mapping has none (or None).
        Unknown keys raise ArgumentError (a ValueError) naming them."""
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
            raise ArgumentError("target", "target is required (nats per response token, or '0.75x')")
        return cls(config["target"], config.get("knob", "entropy_coef"), start, **kwargs)

    # ------------------------------------------------------------------ the target
    def _resolve(self, index: int) -> float | None:
        number, relative = self._targets[index]
        if not relative:
            return number
        return None if self.reference is None else number * self.reference

    def target_at(self, step: int) -> float | None:
        """The target (nats) that step ``step``'s entropy is compared with (steps from 1); None while a relative
        target still waits for its window."""
        start = self._resolve(0)
        if self.target_steps is None or start is None:
            return start
        s0, s1 = self.target_steps
        if step <= s0:
            return start
        end = self._resolve(1)
        if end is None:
            return None
        if step >= s1:
            return end
        return start + (end - start) * (step - s0) / (s1 - s0)

    @property
    def target(self) -> float | None:
        """The target the next measured entropy will be compared with (nats; None until a relative target's window
        is complete)."""
        return self.target_at(self.updates + 1)

    # ------------------------------------------------------------------ the rule
    def is_low(self, entropy: float, target: float | None = None) -> bool:
        """Whether ``entropy`` is below ``target`` (default: the next step's, ``self.target``), at or below it with
        ``inclusive``; False while there is no target yet."""
        t = self.target if target is None else target
        if t is None:
            return False
        return entropy <= t if self.inclusive else entropy < t

    @property
    def applied(self) -> float:
        """The knob's value for the next update: ``value``, or the neutral value while ``gate`` holds it off."""
        if self.gate and (self.last_entropy is None or self.last_target is None
                          or not self.is_low(self.last_entropy, self.last_target)):
            assert self.spec.neutral is not None  # __init__ refuses gate on knobs without one
            return self.spec.neutral
        return self.value

    @property
    def error(self) -> float | None:
        """target − H at the last update (nats), None before the first, or while there was no target."""
        if self.last_entropy is None or self.last_target is None:
            return None
        return self.last_target - self.last_entropy

    def update(self, entropy: float) -> float:
        """Take the entropy H measured after an update (nats per response token, over all ranks) and move the
        value by the rule; returns the new value. While a relative target waits for its window the value stays.

        Raises:
            ValueError: ``entropy`` not a finite number; a relative target of a rule that divides by it whose
                window's mean entropy is 0.
        """
        try:
            h = float(entropy)
        except (TypeError, ValueError):
            raise ValueError(f"entropy must be a finite number, got {entropy!r}") from None
        if not math.isfinite(h):
            raise ValueError(f"entropy must be a finite number, got {entropy!r}")
        step = self.updates + 1
        if self.relative and self.reference is None:
            self._window_sum += h
            if step == self.window:
                reference = self._window_sum / self.window
                if reference <= 0 and self.rule != "step":
                    raise ValueError(f"the relative target's reference, the mean entropy of the first {self.window} "
                                     f"steps, is {reference:g}: rule {self.rule} needs a target > 0")
                self.reference = reference
        target = self.target_at(step)
        self.last_entropy, self.last_target, self.updates = h, target, step
        if target is None:
            return self.value
        if self.rule == "step":
            assert self.delta is not None
            # one delta in the direction that raises entropy when it is low, the other way when it is not
            change = self.delta if self.is_low(h, target) == (self.spec.direction > 0) else -self.delta
            moved = self.value + change
        elif self.rule == "proportional":
            moved = self.value * math.exp(self.spec.direction * self.gain * (target - h) / target)
        else:
            moved = self._pi(h, target)
        self.value = min(self.max, max(self.min, moved))
        return self.value

    def _pi(self, h: float, target: float) -> float:
        """The PI rule's unclipped output; moves ``integral`` (bounded, conditional integration)."""
        assert self.kp is not None and self.ki is not None and self.integral_max is not None
        e, s = (target - h) / target, self.spec.direction
        bound = self.integral_max
        integral = min(bound, max(-bound, self.integral + e))
        out = self.init + s * (self.kp * e + self.ki * integral)
        if (out > self.max and s * e > 0) or (out < self.min and s * e < 0):
            # at a bound, and the error pushes further: integrating would only wind up (conditional integration)
            integral = self.integral
            out = self.init + s * (self.kp * e + self.ki * integral)
        self.integral = integral
        return out

    # ------------------------------------------------------------------ checkpointing and logging
    def config(self) -> dict[str, Any]:
        """The mapping ``from_config`` turns back into this controller (before its first update)."""
        out = {"target": self._target_spec[0], "knob": self.knob, "rule": self.rule, "init": self.init,
               "delta": self.delta, "gain": self.gain, "min": self.min, "max": self.max, "gate": self.gate,
               "inclusive": self.inclusive}
        later = {"kp": self.kp, "ki": self.ki, "integral_max": self._integral_max_given,
                 "window": self.window if self._window_given else None, "target_end": self._target_spec[1],
                 "target_steps": None if self.target_steps is None else list(self.target_steps)}
        return {**out, **{k: v for k, v in later.items() if v is not None}}

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: the configuration, the value, the last entropy and target, the update count, the PI
        rule's integral and a relative target's reference."""
        return {"config": self.config(), "value": self.value, "last_entropy": self.last_entropy,
                "last_target": self.last_target, "updates": self.updates, "integral": self.integral,
                "reference": self.reference, "window_sum": self._window_sum}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()`` (also one written before the PI rule and relative targets existed); the
        configuration must match this controller's.

        Raises:
            ValueError: missing keys, another configuration, or a value outside [min, max].
        """
        for key in ("config", "value", "last_entropy", "updates"):
            if key not in state:
                raise ValueError(f"entropy-control state is missing {key!r}")
        saved = {k: v for k, v in {**_LATER_DEFAULTS, **dict(state["config"])}.items() if v is not None}
        mine = {k: v for k, v in self.config().items() if v is not None}
        if saved != mine:
            raise ValueError(f"entropy-control state {dict(state['config'])!r} does not match this run's "
                             f"{self.config()!r}")
        value = _number(state["value"], "value")
        if not self.min <= value <= self.max:
            raise ValueError(f"entropy-control value {value!r} is outside [{self.min:g}, {self.max:g}]")
        last = state["last_entropy"]
        self.value = value
        self.last_entropy = None if last is None else _number(last, "last_entropy")
        self.updates = int(state["updates"])
        last_target = state.get("last_target", self.target_at(self.updates) if self.updates else None)
        self.last_target = None if last_target is None else _number(last_target, "last_target")
        self.integral = _number(state.get("integral", 0.0), "integral")
        reference = state.get("reference")
        self.reference = None if reference is None else _number(reference, "reference")
        self._window_sum = _number(state.get("window_sum", 0.0), "window_sum")

    def metrics(self) -> dict[str, float]:
        """``entropy_control/value`` (the knob's value now), ``/applied`` (what the next update uses), ``/error``
        (target − H at the last update, once there is one) and ``/target`` (the target it was compared with)."""
        out = {"entropy_control/value": self.value, "entropy_control/applied": self.applied}
        if self.error is not None and self.last_target is not None:
            out["entropy_control/error"] = self.error
            out["entropy_control/target"] = self.last_target
        return out

    def __repr__(self) -> str:
        return f"EntropyController({self.config()!r}, value={self.value:g}, updates={self.updates})"


def controlled(loss_config, controller: EntropyController | None):
    """``loss_config`` (a ``fastcov.losses.LossConfig``) with the controller's knob set to ``controller.applied``;
    ``loss_config`` itself when ``controller`` is None."""
    return loss_config if controller is None else dataclasses.replace(
        loss_config, **{KNOBS[controller.knob].loss_field: controller.applied})


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
