"""The target-entropy controller (fastcov.entropy_control) against the published rules it reproduces (TRL 1.16's
use_adaptive_entropy, Skywork-OR1's adaptive entropy, Jin et al.'s λ schedule), its proportional rule, its state;
Cheng et al.'s entropy-based advantage shaping against its formula. The all-rank entropy on 2 gloo processes:
tests/library/e2e/test_entropy_control_e2e.py."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

import fastcov
from fastcov.entropy_control import KNOBS, EntropyController, all_rank_entropy
from fastcov.schedules import PositiveWeightSchedule


def _entropies(rng: random.Random, target: float, n: int = 60) -> list[float]:
    """Entropies around the target, with exact ties (H == target) mixed in, where the rules differ."""
    return [target if rng.random() < 0.15 else target + rng.uniform(-0.3, 0.3) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_step_rule_is_trls_adaptive_entropy(seed):
    """TRL 1.16 (GRPOTrainer._compute_loss): after each optimizer step, coef ← min(coef + delta, max) when the
    all-rank entropy H ≤ target, else max(coef − delta, min); the bonus of a step is coef while the last measured
    H ≤ target, else 0 (and 0 before the first measurement: last H = inf)."""
    rng = random.Random(seed)
    target, delta = rng.uniform(0.2, 1.0), rng.choice([0.005, 0.01, 0.003])
    lo, hi, coef = 0.0, rng.uniform(0.02, 0.05), rng.uniform(0.0, 0.02)
    ctl = EntropyController(target, "entropy_coef", coef, rule="step", delta=delta, min=lo, max=hi, gate=True,
                            inclusive=True)
    last = math.inf
    for h in _entropies(rng, target):
        assert ctl.applied == (coef if last <= target else 0.0)
        coef = min(coef + delta, hi) if h <= target else max(coef - delta, lo)
        last = h
        assert ctl.update(h) == coef and ctl.value == coef
    assert ctl.updates == 60 and ctl.error == target - last


@pytest.mark.parametrize("seed", range(4))
def test_step_rule_is_skyworks_adaptive_entropy(seed):
    """Skywork-OR1: c ← clip(c + Δ, min, max) when H < target, clip(c − Δ, min, max) otherwise; the bonus always
    applies (no gate). Their defaults: target 0.2, Δ 1e-4, [0, 0.005]."""
    rng = random.Random(100 + seed)
    target, delta, lo, hi, c = 0.2, 1e-4, 0.0, 0.005, 0.0
    ctl = EntropyController(target, "entropy_coef", c, delta=delta, min=lo, max=hi)
    for h in _entropies(rng, target):
        assert ctl.applied == c
        c = min(hi, max(lo, c + delta if h < target else c - delta))
        assert ctl.update(h) == c


@pytest.mark.parametrize("seed", range(3))
def test_jin_schedule_is_the_controller_on_pos_weight(seed):
    """λ ← clip(λ − Δ, 0, 1) if H < δ else clip(λ + Δ, 0, 1): the pos_weight knob lowers λ to raise H."""
    rng = random.Random(200 + seed)
    delta_, step = rng.uniform(0.1, 0.4), rng.choice([0.05, 0.1, 0.3])
    sched = PositiveWeightSchedule("entropy", init=0.5, threshold=delta_, step_size=step)
    ctl = EntropyController(delta_, "pos_weight", 0.5, delta=step)
    lam = 0.5
    for h in _entropies(rng, delta_):
        lam = min(1.0, max(0.0, lam - step if h < delta_ else lam + step))
        assert sched.step(entropy=h) == lam
        assert ctl.update(h) == lam


@pytest.mark.parametrize("knob", list(KNOBS))
def test_proportional_rule_formula(knob):
    rng = random.Random(hash(knob) % 1000)
    spec = KNOBS[knob]
    lo, hi = 1e-4, (0.9 if spec.high <= 1 else 5.0)
    v, target, gain = rng.uniform(0.01, 0.5), rng.uniform(0.2, 1.0), rng.uniform(0.1, 2.0)
    ctl = EntropyController(target, knob, v, rule="proportional", gain=gain, min=lo, max=hi)
    for h in _entropies(rng, target, 40):
        v = min(hi, max(lo, v * math.exp(spec.direction * gain * (target - h) / target)))
        assert ctl.update(h) == pytest.approx(v, rel=1e-15)


def _closed_loop(ctl: EntropyController, steps: int = 200) -> list[float]:
    """A plant where entropy follows the bonus coefficient with lag: H ← H + 0.3·(0.1 + 40·coef − H) per step.
    Holding H = 0.5 needs coef = 0.01."""
    h, out = 0.1, []
    for _ in range(steps):
        h += 0.3 * (0.1 + 40.0 * ctl.applied - h)
        ctl.update(h)
        out.append(h)
    return out


def test_both_rules_hold_a_toy_plant_at_the_target_and_proportional_settles_tighter():
    step = _closed_loop(EntropyController(0.5, "entropy_coef", 1e-3, delta=5e-4, max=0.05))
    prop = _closed_loop(EntropyController(0.5, "entropy_coef", 1e-3, rule="proportional", gain=0.5, min=1e-5, max=0.05))
    tail = slice(150, None)
    assert max(abs(h - 0.5) for h in prop[tail]) < 1e-3  # settles on the target
    assert 1e-3 < max(abs(h - 0.5) for h in step[tail]) < 0.1  # a ±delta limit cycle around it


def test_state_round_trip_resumes_bit_exact():
    rng = random.Random(7)
    hs = [rng.uniform(0.0, 1.0) for _ in range(30)]
    make = lambda: EntropyController(0.5, "kl_cov_coef", 1.0, rule="proportional", gain=0.7, min=1e-3, max=10.0)  # noqa: E731
    full = make()
    values = [full.update(h) for h in hs]
    half = make()
    for h in hs[:13]:
        half.update(h)
    state = json.loads(json.dumps(half.state_dict()))  # a checkpoint holds it as JSON
    resumed = make()
    resumed.load_state_dict(state)
    assert [resumed.update(h) for h in hs[13:]] == values[13:]
    assert resumed.state_dict() == full.state_dict()
    other = EntropyController(0.4, "kl_cov_coef", 1.0, rule="proportional", gain=0.7, min=1e-3, max=10.0)
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(state)


@pytest.mark.parametrize("kwargs, word", [
    (dict(knob="nope"), "knob"), (dict(rule="pid"), "rule"), (dict(delta=None), "delta"), (dict(delta=-1), "delta"),
    (dict(target=-0.1), "target"), (dict(init=2.0), "init"), (dict(min=0.5, max=0.1, init=0.3), "min must be <= max"),
    (dict(knob="kl_cov_ratio", min=0.0, init=0.1), "min must lie in"),
    (dict(knob="pos_weight", max=1.5, init=0.5), "max must lie in"), (dict(knob="kl_cov_ratio", init=0.1, gate=True), "gate"),
    (dict(rule="proportional", init=0.1), "min must be > 0"), (dict(gain=0.0), "gain"), (dict(max=float("nan")), "max"),
])
def test_bad_arguments_name_themselves(kwargs, word):
    args = dict(target=0.3, knob="entropy_coef", init=0.0, delta=0.01)
    args.update(kwargs)
    target, knob, init = args.pop("target"), args.pop("knob"), args.pop("init")
    with pytest.raises(ValueError, match=word):
        EntropyController(target, knob, init, **args)


def test_from_config_and_update_errors():
    ctl = EntropyController.from_config({"target": 0.3, "knob": "pos_weight", "delta": 0.05}, init=1.0)
    assert ctl.value == 1.0 and ctl.applied == 1.0 and ctl.error is None
    assert EntropyController.from_config(ctl.config()).config() == ctl.config()
    with pytest.raises(ValueError, match="unknown entropy-control key 'tagret'"):
        EntropyController.from_config({"tagret": 0.3})
    with pytest.raises(ValueError, match="target is required"):
        EntropyController.from_config({"delta": 0.1}, init=0.0)
    for bad in (float("nan"), "x", None):
        with pytest.raises(ValueError, match="entropy must be a finite number"):
            ctl.update(bad)
    assert ctl.updates == 0


def test_gate_uses_the_knobs_off_value():
    ctl = EntropyController(0.3, "pos_weight", 0.4, delta=0.1, gate=True)
    assert ctl.applied == 1.0  # before any measurement: off (λ = 1, no re-weighting)
    ctl.update(0.5)  # high entropy: λ rises, gate stays shut
    assert ctl.applied == 1.0 and ctl.value == pytest.approx(0.5)
    ctl.update(0.1)
    assert ctl.applied == ctl.value == pytest.approx(0.4)
    assert ctl.metrics()["entropy_control/error"] == pytest.approx(0.2)


def test_public_api():
    assert fastcov.EntropyController is EntropyController
    assert fastcov.entropy_control.all_rank_entropy is all_rank_entropy


# ---------------------------------------------------------------- Cheng et al.'s advantage shaping


@pytest.mark.parametrize("seed", range(3))
def test_entropy_advantage_formula(seed):
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(5, 9, generator=gen)
    adv[0, :3] = 0.0
    ent = (torch.rand(5, 9, generator=gen) * 4).requires_grad_()
    mask = torch.rand(5, 9, generator=gen) < 0.8
    alpha, kappa = float(torch.rand(1, generator=gen)) + 0.05, 2.0
    out = fastcov.advantages.entropy_advantage(adv, ent, mask, alpha=alpha, kappa=kappa)
    for i in range(5):
        for t in range(9):
            a, h = float(adv[i, t]), float(ent[i, t].detach())
            want = a + min(alpha * h, abs(a) / kappa) if mask[i, t] else 0.0
            assert float(out[i, t]) == pytest.approx(want, rel=1e-6, abs=1e-7)
    valid = mask & (adv != 0)
    assert torch.all(torch.sign(out[valid]) == torch.sign(adv[valid]))  # κ > 1 never flips a sign
    assert torch.all(out[~mask] == 0) and not out.requires_grad  # the entropy is detached
    assert torch.equal(fastcov.advantages.entropy_advantage(adv, ent, alpha=0.0, kappa=kappa), adv)


@pytest.mark.parametrize("kwargs, word", [(dict(alpha=-1.0), "alpha"), (dict(kappa=0.0), "kappa"),
                                          (dict(alpha=float("inf")), "alpha")])
def test_entropy_advantage_bad_arguments(kwargs, word):
    args = dict(alpha=0.1, kappa=2.0) | kwargs
    with pytest.raises(ValueError, match=word):
        fastcov.advantages.entropy_advantage(torch.zeros(2, 3), torch.zeros(2, 3), **args)
    with pytest.raises(ValueError, match="one shape"):
        fastcov.advantages.entropy_advantage(torch.zeros(2, 3), torch.zeros(2, 4), alpha=0.1, kappa=2.0)


def test_the_controller_bench_runs_in_the_simulators_loop(tmp_path):
    from bench import entropy_controllers as B

    assert B.settle_step(np.array([3.0, 1.2, 1.0, 1.05]), 1.0) == 2.0
    assert math.isnan(B.settle_step(np.array([1.0, 1.0, 3.0]), 1.0))
    assert B.main(["--steps", "12", "--seeds", "0", "--target", "2.0", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "entropy-controllers-tabular.json").read_text())
    assert {(r["knob"], r["rule"]) for r in doc["rows"]} == {(k, r) for k in KNOBS for r in ("step", "proportional", "pi")}
    moved = {r["knob"]: r["final_value"] for r in doc["rows"] if r["rule"] == "step"}
    assert moved["entropy_coef"] == pytest.approx(0.0)  # H > target all along: the bonus stays at its floor
    assert moved["kl_cov_coef"] < 1.0  # and β falls from its start


# ---------------------------------------------------------------- the PI rule (issue 60)


def _pi_reference(target, direction, init, kp, ki, bound, lo, hi, entropies):
    """The PI rule written out from its definition (docs/trainer.md): e = (T − H)/T; the integral takes e, clipped
    to ±bound, unless the output it gives lies beyond a bound in the direction e pushes (then it keeps its value);
    the value is init + s·(kp·e + ki·I), clipped to [lo, hi]. Returns the values and integrals after each step."""
    integral, values, integrals = 0.0, [], []
    for h in entropies:
        e = (target - h) / target
        trial = min(bound, max(-bound, integral + e))
        out = init + direction * (kp * e + ki * trial)
        pushes_up = direction * e > 0
        if (out > hi and pushes_up) or (out < lo and direction * e < 0):
            out = init + direction * (kp * e + ki * integral)  # the integral holds
        else:
            integral = trial
        values.append(min(hi, max(lo, out)))
        integrals.append(integral)
    return values, integrals


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("knob", list(KNOBS))
def test_pi_rule_arithmetic_on_random_inputs(knob, seed):
    """On random gains, bounds, targets and entropies (ties with the target, far excursions, bounds hit both ways)
    the controller's values and integral equal the rule written out, and stay inside their bounds."""
    rng = random.Random(1000 * seed + len(knob))
    spec = KNOBS[knob]
    lo = rng.uniform(1e-4, 0.2) if spec.low_open or rng.random() < 0.5 else spec.low
    hi = rng.uniform(lo + 0.1, 1.0 if spec.high <= 1 else 20.0)
    init, target = rng.uniform(lo, hi), rng.uniform(0.05, 2.0)
    kp, ki = rng.choice([0.0, rng.uniform(0.01, 5.0)]), rng.uniform(0.01, 2.0)
    given = rng.choice([None, rng.uniform(0.1, 10.0)])
    bound = given if given is not None else (hi - lo) / ki
    ctl = EntropyController(target, knob, init, rule="pi", kp=kp, ki=ki, integral_max=given, min=lo, max=hi)
    hs = [target if rng.random() < 0.1 else target * rng.uniform(0.2, 2.5) for _ in range(80)]
    values, integrals = _pi_reference(target, spec.direction, init, kp, ki, bound, lo, hi, hs)
    for h, want, want_i in zip(hs, values, integrals, strict=True):
        got = ctl.update(h)
        # the same float64 operations in the same order: equal up to one rounding of the sums
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15) and ctl.integral == pytest.approx(want_i, abs=1e-12)
        assert lo <= got <= hi and abs(ctl.integral) <= bound + 1e-12
        assert ctl.error == pytest.approx(target - h)
    assert ctl.updates == len(hs)


def test_pi_with_ki_zero_is_the_proportional_term_alone():
    rng = random.Random(3)
    ctl = EntropyController(0.4, "kl_cov_coef", 2.0, rule="pi", kp=3.0, ki=0.0, min=0.0, max=10.0)
    for _ in range(30):
        h = rng.uniform(0.1, 0.8)
        assert ctl.update(h) == pytest.approx(min(10.0, max(0.0, 2.0 + 3.0 * (0.4 - h) / 0.4)), rel=1e-15)


def test_pi_anti_windup_leaves_the_bound_as_soon_as_the_error_turns():
    """60 steps far above the target drive β to 0 and stop the integral there (it would otherwise sink to
    −integral_max); the first step below the target lifts β off 0 at once, by the proportional term and one step
    of the integral."""
    ctl = EntropyController(0.25, "kl_cov_coef", 1.0, rule="pi", kp=2.0, ki=0.5, min=0.0, max=10.0)
    for _ in range(60):
        ctl.update(0.5)  # e = −1: β = 1 − 2 − 0.5·I < 0
    assert ctl.value == 0.0 and ctl.integral == 0.0  # held: 1 − 2·1 − 0.5·(−1) < 0 already at the first step
    ctl.update(0.2)  # e = +0.2
    assert ctl.value == pytest.approx(1.0 + 2.0 * 0.2 + 0.5 * 0.2)
    bounded = EntropyController(0.25, "kl_cov_coef", 1.0, rule="pi", kp=0.0, ki=0.5, min=0.0, max=100.0,
                                integral_max=3.0)
    for _ in range(40):
        bounded.update(0.1)  # e = 0.6 per step: the integral stops at its bound 3, β at 1 + 0.5·3
    assert bounded.integral == 3.0 and bounded.value == pytest.approx(2.5)


def _plant(ctl: EntropyController, steps: int = 300, gain: float = 40.0) -> list[float]:
    """The toy plant of _closed_loop: H ← H + 0.3·(0.1 + gain·knob − H); holding H needs knob = (H − 0.1)/gain."""
    h, out = 0.1, []
    for _ in range(steps):
        h += 0.3 * (0.1 + gain * ctl.applied - h)
        ctl.update(h)
        out.append(h)
    return out


def test_pi_settles_on_a_toy_plant_where_the_proportional_term_keeps_an_offset():
    """The plant needs knob 0.01 to hold 0.5 nats. P alone, v = kp·e, settles where 0.5 − H = 0.5·(0.1 + 40·kp·e
    − H)/…: at e* = 0.4/(0.5 + 40·kp) (relative), a steady-state error; PI's integral removes it."""
    kp = 0.02
    p_only = _plant(EntropyController(0.5, "entropy_coef", 0.0, rule="pi", kp=kp, ki=0.0, max=0.05))
    pi = _plant(EntropyController(0.5, "entropy_coef", 0.0, rule="pi", kp=kp, ki=0.002, max=0.05))
    # fixed point of H = 0.1 + 40·kp·(0.5 − H)/0.5: H* = (0.1 + 40·kp) / (1 + 80·kp)
    h_star = (0.1 + 40 * kp) / (1 + 80 * kp)
    assert p_only[-1] == pytest.approx(h_star, rel=1e-9) and 0.5 - h_star > 0.05
    assert max(abs(h - 0.5) for h in pi[-50:]) < 1e-4


def test_pi_settles_in_the_tabular_simulator_where_the_proportional_term_keeps_an_error():
    """The tabular simulator's GRPO (bench/tabular_dynamics.py) on 64 prompts × 64 answers (uncontrolled: 3.6 → ~0.4 nats in 300 steps), β of
    KL-Cov driven to 1.5 nats. PI (kp 5, ki 1) ends with the mean signed error over the last 100 steps near 0;
    the proportional term alone (ki 0) stops where β = 1 + 5·e balances GRPO's pull, ~1 nat short."""
    from bench.tabular_dynamics import DynamicsConfig, TabularProblem, simulate

    target, ends = 1.5, {}
    for ki in (1.0, 0.0):
        ctl = EntropyController(target, "kl_cov_coef", 1.0, rule="pi", kp=5.0, ki=ki, min=0.0, max=10.0)
        run = simulate(TabularProblem.random(seed=0), DynamicsConfig(steps=300, mode="kl_cov", seed=0,
                                                                     entropy_control=ctl))
        ends[ki] = float(np.mean(target - run.entropy[-100:]))
    # PI: the tail's entropy wanders by ~0.03 nats (sd) around the target; the mean of 100 correlated steps within
    # 2% of the target. P alone: more than a third of the target short.
    assert abs(ends[1.0]) < 0.02 * target
    assert ends[0.0] > target / 3


# ---------------------------------------------------------------- relative targets and schedules


def test_relative_target_waits_for_its_window_then_acts():
    hs = [0.40, 0.36, 0.32, 0.30, 0.20, 0.35]
    ctl = EntropyController("0.75x", "kl_cov_coef", 1.0, rule="step", delta=0.5, window=3, max=10.0)
    assert ctl.relative and ctl.target is None
    for h in hs[:2]:
        assert ctl.update(h) == 1.0 and ctl.target is None and ctl.error is None
        assert "entropy_control/error" not in ctl.metrics()
    ref = (0.40 + 0.36 + 0.32) / 3
    ctl.update(hs[2])  # the window's last step: the reference is known and the rule acts on this step
    assert ctl.reference == pytest.approx(ref, rel=1e-15) and ctl.last_target == pytest.approx(0.75 * ref)
    assert ctl.value == 0.5  # 0.32 > 0.27: above the target, β down one delta
    for h in hs[3:]:
        beta = ctl.value + (0.5 if h < 0.75 * ref else -0.5)
        assert ctl.update(h) == pytest.approx(min(10.0, max(0.0, beta)))
    assert ctl.metrics()["entropy_control/target"] == pytest.approx(0.75 * ref)


@pytest.mark.parametrize("seed", range(4))
def test_schedule_moves_the_target_linearly(seed):
    rng = random.Random(seed)
    s0, s1 = rng.randint(0, 20), rng.randint(25, 60)
    start, end = rng.uniform(0.1, 1.0), rng.uniform(0.1, 1.0)
    absolute = EntropyController(start, "entropy_coef", 0.0, delta=0.01, target_end=end, target_steps=(s0, s1))
    for step in range(1, 70):
        want = start if step <= s0 else end if step >= s1 else start + (end - start) * (step - s0) / (s1 - s0)
        assert absolute.target_at(step) == pytest.approx(want, rel=1e-14)
    # relative ends: fractions of the window's mean, with the rule comparing each step with its own target
    ctl = EntropyController("1.0x", "pos_weight", 1.0, rule="pi", kp=0.5, ki=0.1, window=2, target_end="0.5x",
                            target_steps=[s0 + 2, s1 + 2])
    hs = [rng.uniform(0.2, 0.6) for _ in range(70)]
    for step, h in enumerate(hs, start=1):
        ctl.update(h)
        if step >= 2:
            ref = (hs[0] + hs[1]) / 2
            frac = 1.0 if step <= s0 + 2 else 0.5 if step >= s1 + 2 else 1.0 - 0.5 * (step - s0 - 2) / (s1 - s0)
            assert ctl.last_target == pytest.approx(frac * ref, rel=1e-12)


def test_pi_and_relative_target_resume_bit_exact_and_old_states_load():
    rng = random.Random(11)
    hs = [rng.uniform(0.1, 0.9) for _ in range(40)]
    make = lambda: EntropyController("0.8x", "kl_cov_coef", 1.0, rule="pi", kp=2.0, ki=0.3, window=4,  # noqa: E731
                                     target_end=0.3, target_steps=(10, 30), max=10.0)
    full = make()
    values = [full.update(h) for h in hs]
    for cut in (2, 4, 17):  # inside the window, at its end, after it
        half = make()
        for h in hs[:cut]:
            half.update(h)
        resumed = make()
        resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))
        assert [resumed.update(h) for h in hs[cut:]] == values[cut:]
        assert resumed.state_dict() == full.state_dict()
    # a state written before the PI rule and relative targets existed (issue 41's keys only) still loads
    old = EntropyController(0.5, "entropy_coef", 0.0, delta=0.01)
    old.update(0.3)
    state = old.state_dict()
    legacy = {"config": {k: v for k, v in state["config"].items()}, "value": state["value"],
              "last_entropy": state["last_entropy"], "updates": state["updates"]}
    fresh = EntropyController(0.5, "entropy_coef", 0.0, delta=0.01)
    fresh.load_state_dict(legacy)
    assert fresh.value == old.value and fresh.last_target == 0.5 and fresh.error == old.error


@pytest.mark.parametrize("kwargs, word", [
    (dict(rule="pi", ki=0.1), "kp"), (dict(rule="pi", kp=1.0), "ki"), (dict(rule="pi", kp=1.0, ki=-0.1), "ki"),
    (dict(rule="pi", kp=-1.0, ki=0.1), "kp"), (dict(rule="pi", kp=1.0, ki=0.1, integral_max=0.0), "integral_max"),
    (dict(rule="step", delta=0.1, kp=1.0), "kp is the pi rule's"), (dict(rule="pi", kp=1.0, ki=0.1, target=0.0),
                                                                   "target must be > 0"),
    (dict(delta=0.1, target="abc"), "target must be nats"), (dict(delta=0.1, target="0x"), "target must be nats"),
    (dict(delta=0.1, target="-0.5x"), "target must be nats"), (dict(delta=0.1, target=float("inf")), "target"),
    (dict(delta=0.1, target_end=0.2), "target_steps"), (dict(delta=0.1, target_steps=(0, 10)), "needs target_end"),
    (dict(delta=0.1, target_end=0.2, target_steps=(10, 10)), "s0 < s1"),
    (dict(delta=0.1, target_end=0.2, target_steps=(-1, 10)), "target_steps"),
    (dict(delta=0.1, target_end=0.2, target_steps=(1, 2, 3)), "two steps"),
    (dict(delta=0.1, target_end="1x0", target_steps=(1, 5)), "target_end must be nats"),
    (dict(delta=0.1, window=3), "window applies to a relative target"),
    (dict(delta=0.1, target="0.5x", window=0), "window must be an integer >= 1"),
    (dict(rule="proportional", min=0.01, init=0.1, target=0.3, target_end=0.0, target_steps=(1, 5)),
     "target_end must be > 0"),
])
def test_pi_and_target_arguments_name_themselves(kwargs, word):
    args = dict(target=0.3, knob="entropy_coef", init=0.0) | kwargs
    target, knob, init = args.pop("target"), args.pop("knob"), args.pop("init")
    with pytest.raises(ValueError, match=word):
        EntropyController(target, knob, init, **args)


def test_relative_target_with_a_zero_reference_is_refused_by_the_rules_that_divide_by_it():
    ctl = EntropyController("0.5x", "kl_cov_coef", 1.0, rule="pi", kp=1.0, ki=0.1, window=2)
    ctl.update(0.0)
    with pytest.raises(ValueError, match="reference"):
        ctl.update(0.0)
