"""PositiveWeightSchedule: the entropy-guided rule of docs/design.md §4, stage/epoch kinds, checkpointing, validation."""

from __future__ import annotations

import json
import random

import pytest

from fastcov.schedules import PositiveWeightSchedule


def _reference_entropy_rule(lam0, delta, step, entropies):
    """Independent re-statement of docs/design.md §4: λ ← clip(λ − Δ) when H < δ, else clip(λ + Δ)."""
    lam, out = lam0, []
    for h in entropies:
        lam = lam - step if h < delta else lam + step
        lam = 0.0 if lam < 0.0 else (1.0 if lam > 1.0 else lam)
        out.append(lam)
    return out


def test_entropy_guided_defaults_and_direction():
    s = PositiveWeightSchedule()
    assert (s.kind, s.init, s.threshold, s.step_size, s.value) == ("entropy", 0.0, 0.2, 0.05, 0.0)
    # healthy entropy (>= δ): λ rises by Δ per step, saturating at 1
    vals = [s.step(entropy=0.5) for _ in range(25)]
    assert vals[0] == pytest.approx(0.05)
    assert vals[3] == pytest.approx(0.20)
    assert vals[-1] == 1.0 and max(vals) == 1.0
    # H exactly at δ counts as "otherwise" (not H < δ): stays at 1
    assert s.step(entropy=0.2) == 1.0
    # low entropy: λ falls by Δ, floor at 0
    assert s.step(entropy=0.1) == pytest.approx(0.95)
    low = [s.step(entropy=0.0) for _ in range(30)]
    assert low[-1] == 0.0 and min(low) == 0.0


def test_entropy_guided_matches_reference_on_random_trace():
    rng = random.Random(1234)
    lam0, delta, step = rng.uniform(0, 1), rng.uniform(0.1, 0.5), rng.uniform(0.01, 0.2)
    s = PositiveWeightSchedule("entropy", init=lam0, threshold=delta, step_size=step)
    entropies = [rng.uniform(0.0, 2 * delta) for _ in range(200)]
    got = [s.step(entropy=h) for h in entropies]
    assert got == pytest.approx(_reference_entropy_rule(lam0, delta, step, entropies), abs=1e-12)
    assert s.step_count == 200 and s.value == got[-1]


def test_stage_schedule():
    s = PositiveWeightSchedule.from_config({"kind": "stage", "stages": [[0, 1.0], [3, 0.5], [5, 0.0]]})
    seen = [s.value] + [s.step() for _ in range(7)]
    assert seen == [1.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    assert s.step(entropy=0.01) == 0.0  # entropy ignored


def test_epoch_schedule():
    s = PositiveWeightSchedule("epoch", values=[0.2, 0.6, 1.0], steps_per_epoch=2)
    seen = [s.value] + [s.step() for _ in range(7)]
    assert seen == [0.2, 0.2, 0.6, 0.6, 1.0, 1.0, 1.0, 1.0]


def test_constant_schedule():
    s = PositiveWeightSchedule.from_config({"kind": "constant", "init": 0.3})
    assert s.value == 0.3 and s.step() == 0.3 and s.step(entropy=0.0) == 0.3
    assert PositiveWeightSchedule("constant").value == 1.0


@pytest.mark.parametrize("config", [
    {"kind": "entropy", "init": 0.4, "threshold": 0.3, "step_size": 0.1},
    {"kind": "stage", "stages": [[0, 0.9], [2, 0.1]]},
    {"kind": "epoch", "values": [1.0, 0.5], "steps_per_epoch": 3},
])
def test_checkpoint_roundtrip_through_json(config):
    rng = random.Random(7)
    a = PositiveWeightSchedule.from_config(config)
    for _ in range(4):
        a.step(entropy=rng.uniform(0, 0.6))
    state = json.loads(json.dumps(a.state_dict()))
    b = PositiveWeightSchedule.from_config(config)
    b.load_state_dict(state)
    assert (b.value, b.step_count) == (a.value, a.step_count)
    entropies = [rng.uniform(0, 0.6) for _ in range(6)]
    assert [a.step(entropy=h) for h in entropies] == [b.step(entropy=h) for h in entropies]
    assert PositiveWeightSchedule.from_config(a.config()).config() == a.config()


def test_load_state_dict_rejects_other_config_and_bad_state():
    a = PositiveWeightSchedule("entropy", threshold=0.3)
    b = PositiveWeightSchedule("entropy", threshold=0.2)
    with pytest.raises(ValueError, match="does not match"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="missing 'value'"):
        b.load_state_dict({"config": b.config(), "step_count": 0})
    bad = b.state_dict() | {"value": 1.5}
    with pytest.raises(ValueError, match="value must be a number in"):
        b.load_state_dict(bad)


@pytest.mark.parametrize("config, match", [
    ({"kind": "cosine"}, "kind must be one of"),
    ({"kind": "entropy", "init": 1.5}, "init must be a number in"),
    ({"kind": "entropy", "init": float("nan")}, "init must be a number in"),
    ({"kind": "entropy", "threshold": -0.1}, "threshold must be a positive number"),
    ({"kind": "entropy", "step_size": 2.0}, "step_size must be in"),
    ({"kind": "entropy", "step_size": "big"}, "step_size must be a positive number"),
    ({"kind": "entropy", "delta": 0.2}, "unknown positive-weight schedule key 'delta'"),
    ({"kind": "entropy", "stages": [[0, 1.0]]}, "'stages' is not used by kind='entropy'"),
    ({"kind": "stage"}, "stages is required"),
    ({"kind": "stage", "stages": []}, "stages must not be empty"),
    ({"kind": "stage", "stages": [[1, 1.0]]}, "stages must start at step 0"),
    ({"kind": "stage", "stages": [[0, 1.0], [5, 0.5], [5, 0.2]]}, "stages steps must increase strictly"),
    ({"kind": "stage", "stages": [[0, 1.0], [2, -0.5]]}, r"stages\[1\] λ must be a number in"),
    ({"kind": "stage", "stages": [[0, 1.0], [2.5, 0.5]]}, r"stages\[1\] step must be a non-negative integer"),
    ({"kind": "stage", "stages": [[0, 1.0, 3]]}, r"stages\[0\] must be a \(step, λ\) pair"),
    ({"kind": "epoch", "values": [1.0]}, "steps_per_epoch is required"),
    ({"kind": "epoch", "steps_per_epoch": 4}, "values is required"),
    ({"kind": "epoch", "values": [], "steps_per_epoch": 4}, "values must be a non-empty list"),
    ({"kind": "epoch", "values": [1.0, 2.0], "steps_per_epoch": 4}, r"values\[1\] must be a number in"),
    ({"kind": "epoch", "values": [1.0], "steps_per_epoch": 0}, "steps_per_epoch must be a positive integer"),
])
def test_from_config_validation_names_the_argument(config, match):
    with pytest.raises(ValueError, match=match):
        PositiveWeightSchedule.from_config(config)


def test_constructor_validation_and_step_requirements():
    with pytest.raises(ValueError, match="init is not used by kind='stage'"):
        PositiveWeightSchedule("stage", stages=[(0, 1.0)], init=0.5)
    with pytest.raises(ValueError, match="config must be a mapping"):
        PositiveWeightSchedule.from_config([("kind", "entropy")])
    s = PositiveWeightSchedule()
    with pytest.raises(ValueError, match="entropy is required"):
        s.step()
    with pytest.raises(ValueError, match="entropy must be a finite number"):
        s.step(entropy=float("inf"))
    assert s.step_count == 0 and s.value == 0.0  # failed steps change nothing
    assert PositiveWeightSchedule.from_config(None).config() == PositiveWeightSchedule().config()
