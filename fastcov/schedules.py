"""Schedules for the positive-advantage weight λ of Jin et al. (2025, arXiv 2511.05993).

Jin et al. find that tokens with positive advantage drive entropy collapse and propose re-weighting
them: the per-token policy loss of every token with A > 0 is multiplied by λ ∈ [0, 1] (tokens with
A ≤ 0 keep weight 1).  This module only decides *which* λ to use at each step; applying it is a
modifier of the policy loss (``advantages[advantages > 0] *= λ`` is equivalent for the losses in
docs/design.md §4, whose per-token loss is linear in A at fixed ratio).

Kinds
-----
``"entropy"`` (entropy-guided, docs/design.md §4)
    ``λ`` starts at ``init`` (default 0).  After each step, given that step's policy entropy ``H``::

        λ ← clip(λ − Δ, 0, 1)   if H < δ      (entropy too low: damp the positive tokens)
        λ ← clip(λ + Δ, 0, 1)   otherwise     (entropy healthy: let them learn)

    with ``δ = threshold`` (default 0.2) and ``Δ = step_size`` (default 0.05). The rule is the step rule of
    ``fastcov.entropy_control.EntropyController`` on the knob ``pos_weight`` (bounds [0, 1]), which this
    kind runs; ``algo.entropy_control`` with ``knob: pos_weight`` is the same controller in the trainer.
    This is exactly the ``λ ← clip(λ ∓ Δ, 0, 1) when H < δ / otherwise`` rule of docs/design.md §4; the
    direction follows from positive-advantage tokens being the ones that lower entropy.
``"stage"``
    piecewise constant: ``stages=[(0, λ0), (s1, λ1), ...]`` uses ``λi`` from step ``si`` on.  The first
    stage must start at step 0 and the steps must increase strictly.
``"epoch"``
    ``values=[λ for epoch 0, λ for epoch 1, ...]`` with ``steps_per_epoch`` optimizer steps per epoch
    (epoch = step // steps_per_epoch); after the last listed epoch the last value stays.
``"constant"``
    ``λ = init`` forever (a fixed re-weighting, or λ = 1 for "off").

Use
---
::

    sched = PositiveWeightSchedule.from_config({"kind": "entropy", "threshold": 0.2, "step_size": 0.05})
    for step in range(n_steps):
        lam = sched.value                  # λ for this step's update
        ... train with positive advantages scaled by lam, measure entropy H ...
        sched.step(entropy=H)              # -> λ for the next step

``state_dict()`` / ``load_state_dict()`` checkpoint the schedule (plain Python scalars, JSON-safe).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from fastcov.entropy_control import EntropyController

__all__ = ["PositiveWeightSchedule", "SCHEDULE_KINDS"]

SCHEDULE_KINDS = ("entropy", "stage", "epoch", "constant")

# The arguments each kind accepts in from_config (besides "kind").
_KIND_KEYS: dict[str, tuple[str, ...]] = {
    "entropy": ("init", "threshold", "step_size"),
    "stage": ("stages",),
    "epoch": ("values", "steps_per_epoch"),
    "constant": ("init",),
}


def _as_weight(value: Any, name: str) -> float:
    """A λ value: a real number in [0, 1]; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}") from None
    if not math.isfinite(out) or not 0.0 <= out <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return out


def _as_positive(value: Any, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if not math.isfinite(out) or out < 0.0 or (out == 0.0 and not allow_zero):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return out


def _as_step(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class PositiveWeightSchedule:
    """The weight λ ∈ [0, 1] on positive-advantage tokens, step by step (see the module docstring).

    Args:
        kind: one of ``"entropy"``, ``"stage"``, ``"epoch"``, ``"constant"``.
        init: λ at step 0 for ``"entropy"`` (default 0.0) and the fixed λ for ``"constant"`` (default 1.0).
        threshold: δ of the entropy-guided rule (nats; default 0.2).
        step_size: Δ of the entropy-guided rule (default 0.05).
        stages: for ``"stage"``: iterable of ``(start_step, λ)`` pairs, first start 0, strictly increasing.
        values: for ``"epoch"``: λ per epoch (non-empty).
        steps_per_epoch: for ``"epoch"``: optimizer steps per epoch (positive int).

    Raises:
        ValueError: naming the offending argument.
    """

    def __init__(
        self,
        kind: str = "entropy",
        *,
        init: float | None = None,
        threshold: float = 0.2,
        step_size: float = 0.05,
        stages: Iterable[tuple[int, float]] | None = None,
        values: Iterable[float] | None = None,
        steps_per_epoch: int | None = None,
    ) -> None:
        if kind not in SCHEDULE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(SCHEDULE_KINDS)}, got {kind!r}")
        self.kind = kind
        self.threshold = _as_positive(threshold, "threshold", allow_zero=True)
        self.step_size = _as_positive(step_size, "step_size", allow_zero=True)
        if self.step_size > 1.0:
            raise ValueError(f"step_size must be in [0, 1], got {step_size!r}")
        self.stages: list[tuple[int, float]] | None = None
        self.values: list[float] | None = None
        self.steps_per_epoch: int | None = None

        if kind in ("stage", "epoch") and init is not None:
            raise ValueError(f"init is not used by kind={kind!r}; give the λ values through "
                             f"{'stages' if kind == 'stage' else 'values'}")
        if kind == "stage":
            if stages is None:
                raise ValueError("stages is required for kind='stage' (a list of (step, λ) pairs)")
            self.stages = self._check_stages(stages)
        elif stages is not None:
            raise ValueError(f"stages is only used by kind='stage', not kind={kind!r}")
        if kind == "epoch":
            if values is None:
                raise ValueError("values is required for kind='epoch' (λ per epoch)")
            if steps_per_epoch is None:
                raise ValueError("steps_per_epoch is required for kind='epoch'")
            vals = list(values) if not isinstance(values, (str, bytes)) else None
            if not vals:
                raise ValueError(f"values must be a non-empty list of numbers in [0, 1], got {values!r}")
            self.values = [_as_weight(v, f"values[{i}]") for i, v in enumerate(vals)]
            spe = _as_step(steps_per_epoch, "steps_per_epoch")
            if spe == 0:
                raise ValueError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
            self.steps_per_epoch = spe
        else:
            if values is not None:
                raise ValueError(f"values is only used by kind='epoch', not kind={kind!r}")
            if steps_per_epoch is not None:
                raise ValueError(f"steps_per_epoch is only used by kind='epoch', not kind={kind!r}")

        self.init = _as_weight(init if init is not None else (1.0 if kind == "constant" else 0.0), "init")
        self.step_count = 0
        self._value = self._scheduled(0) if kind in ("stage", "epoch") else self.init
        # the entropy-guided rule is the target-entropy controller's step rule on λ (one rule in the code)
        self._controller = EntropyController(self.threshold, "pos_weight", self.init, rule="step",
                                             delta=self.step_size, min=0.0, max=1.0) if kind == "entropy" else None

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _check_stages(stages: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
        if isinstance(stages, (str, bytes, Mapping)):
            raise ValueError(f"stages must be a list of (step, λ) pairs, got {stages!r}")
        try:
            items = list(stages)
        except TypeError:
            raise ValueError(f"stages must be a list of (step, λ) pairs, got {stages!r}") from None
        if not items:
            raise ValueError("stages must not be empty")
        out: list[tuple[int, float]] = []
        for i, item in enumerate(items):
            try:
                start, lam = item
            except (TypeError, ValueError):
                raise ValueError(f"stages[{i}] must be a (step, λ) pair, got {item!r}") from None
            start = _as_step(start, f"stages[{i}] step")
            lam = _as_weight(lam, f"stages[{i}] λ")
            if i == 0 and start != 0:
                raise ValueError(f"stages must start at step 0, got first step {start}")
            if out and start <= out[-1][0]:
                raise ValueError(f"stages steps must increase strictly, got {out[-1][0]} then {start}")
            out.append((start, lam))
        return out

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> PositiveWeightSchedule:
        """Build from a plain mapping (e.g. a YAML section).

        ``{"kind": "entropy", "init": 0.0, "threshold": 0.2, "step_size": 0.05}``,
        ``{"kind": "stage", "stages": [[0, 1.0], [100, 0.5]]}``,
        ``{"kind": "epoch", "values": [1.0, 0.5], "steps_per_epoch": 50}``,
        ``{"kind": "constant", "init": 0.5}``.  ``kind`` defaults to ``"entropy"``; ``None`` or ``{}``
        gives the default entropy-guided schedule.  Unknown keys and keys that the kind does not use
        raise ValueError naming the key.
        """
        if config is None:
            config = {}
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a mapping, got {type(config).__name__}")
        kind = config.get("kind", "entropy")
        if kind not in SCHEDULE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(SCHEDULE_KINDS)}, got {kind!r}")
        allowed = _KIND_KEYS[kind]
        for key in config:
            if key == "kind":
                continue
            if key not in allowed:
                known = sorted({k for keys in _KIND_KEYS.values() for k in keys})
                if key in known:
                    raise ValueError(f"{key!r} is not used by kind={kind!r} (it takes {', '.join(allowed)})")
                raise ValueError(f"unknown positive-weight schedule key {key!r}; known keys: kind, {', '.join(known)}")
        kwargs = {k: v for k, v in config.items() if k != "kind"}
        return cls(kind, **kwargs)

    # ------------------------------------------------------------------ stepping
    def _scheduled(self, step: int) -> float:
        if self.kind == "stage":
            assert self.stages is not None
            lam = self.stages[0][1]
            for start, value in self.stages:
                if start <= step:
                    lam = value
                else:
                    break
            return lam
        if self.kind == "epoch":
            assert self.values is not None and self.steps_per_epoch is not None
            epoch = step // self.steps_per_epoch
            return self.values[min(epoch, len(self.values) - 1)]
        return self.init

    @property
    def value(self) -> float:
        """λ to use for the current step (a Python float in [0, 1])."""
        return self._value

    def step(self, entropy: float | None = None) -> float:
        """Advance one optimizer step and return λ for the next step.

        Args:
            entropy: the policy entropy (nats, mean over valid tokens) measured at the step that just
                ran. Required by ``kind="entropy"``; ignored by the other kinds.

        Raises:
            ValueError: ``entropy`` missing or not finite for ``kind="entropy"``.
        """
        if self.kind == "entropy":
            if entropy is None:
                raise ValueError("entropy is required by the entropy-guided schedule (kind='entropy')")
            assert self._controller is not None
            self._controller.value = self._value
            self._value = self._controller.update(entropy)  # it checks that entropy is a finite number
            self.step_count += 1
        else:
            self.step_count += 1
            self._value = self._scheduled(self.step_count)
        return self._value

    # ------------------------------------------------------------------ checkpointing
    def config(self) -> dict[str, Any]:
        """The mapping that :meth:`from_config` turns back into this schedule (at step 0)."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "entropy":
            out.update(init=self.init, threshold=self.threshold, step_size=self.step_size)
        elif self.kind == "constant":
            out.update(init=self.init)
        elif self.kind == "stage":
            out.update(stages=[list(s) for s in self.stages or []])
        else:
            out.update(values=list(self.values or []), steps_per_epoch=self.steps_per_epoch)
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: the configuration plus ``step_count`` and the current ``value``."""
        return {"config": self.config(), "step_count": self.step_count, "value": self._value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the configuration must match this schedule's.

        Raises:
            ValueError: missing keys, a different configuration, or an out-of-range value.
        """
        for key in ("config", "step_count", "value"):
            if key not in state:
                raise ValueError(f"state is missing {key!r}")
        if dict(state["config"]) != self.config():
            raise ValueError(f"state config {dict(state['config'])!r} does not match this schedule's {self.config()!r}")
        self.step_count = _as_step(state["step_count"], "step_count")
        self._value = _as_weight(state["value"], "value")

    def __repr__(self) -> str:
        return f"PositiveWeightSchedule({self.config()!r}, step={self.step_count}, value={self._value:g})"
