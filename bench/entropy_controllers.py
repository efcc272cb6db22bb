"""The target-entropy controller's three rules on every knob, closed loop on the tabular GRPO simulator.

    python -m bench.entropy_controllers --target 1.5 0.6     # 5 knobs x 3 rules x 3 seeds x 2 targets
    python -m bench.entropy_controllers --steps 200 --seeds 0

Each run is ``bench.tabular_dynamics.simulate`` (64 prompts x 64 answers, GRPO, 4 mini-batches per rollout, vanilla
policy gradient, lr 0.1) with an ``EntropyController`` in its loop: the knob's value goes into every step's
LossConfig and the controller takes the mean policy entropy after every rollout batch. Without control the
entropy falls from 3.6 to ~0.4 nats in 200 steps; the target is 1.5 nats. Reported per knob and rule, mean over
seeds: the settling step (the first step after which |H − target| stays within 10 % of the target), the mean
|H − target| over the last 100 steps, the mean signed error target − H over them (a steady-state error shows
here), the largest excursion over them, and the final expected accuracy.
Writes ``bench/results/entropy-controllers-tabular.{json,md}``.

This is a tabular model, not an LLM: it measures how each rule regulates (speed, limit cycle, overshoot) on a
softmax policy that really learns, which is what the choice between the rules turns on; the LLM comparison is
the controllers study (configs/studies/controllers.yaml).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from bench.tabular_dynamics import DynamicsConfig, TabularProblem, simulate
from fastcov.entropy_control import EntropyController

TARGET = 1.5
# knob -> (mode, step rule's init and delta, proportional rule's init and min, PI rule's init and gains); bounds:
# the knob's defaults. The PI gains are knob units per unit of relative error (target − H) / target.
KNOB_SETTINGS = {
    "entropy_coef": ("vanilla", dict(init=0.0, delta=0.005), dict(init=0.01, min=1e-4),
                     dict(init=0.0, kp=0.1, ki=0.02)),
    "kl_cov_coef": ("kl_cov", dict(init=1.0, delta=0.5), dict(init=1.0, min=0.01), dict(init=1.0, kp=5.0, ki=1.0)),
    "kl_cov_ratio": ("kl_cov", dict(init=0.02, delta=0.01), dict(init=0.02, min=1e-3),
                     dict(init=0.02, kp=0.1, ki=0.05)),
    "clip_cov_ratio": ("clip_cov", dict(init=0.02, delta=0.01), dict(init=0.02, min=1e-3),
                       dict(init=0.02, kp=0.1, ki=0.05)),
    "pos_weight": ("vanilla", dict(init=1.0, delta=0.05), dict(init=1.0, min=0.01), dict(init=1.0, kp=1.0, ki=0.25)),
}
RULES = ("step", "proportional", "pi")
GAIN = 0.5


def settle_step(entropy: np.ndarray, target: float, tol: float = 0.1) -> float:
    """First step after which |H − target| ≤ tol·target for good (NaN if never)."""
    outside = np.flatnonzero(np.abs(entropy - target) > tol * target)
    if outside.size == 0:
        return 0.0
    last = int(outside[-1]) + 1
    return float(last) if last < len(entropy) else math.nan


def run_one(knob: str, rule: str, seed: int, steps: int, target: float = TARGET) -> dict:
    mode, step_args, prop_args, pi_args = KNOB_SETTINGS[knob]
    args = {"step": dict(step_args), "proportional": dict(prop_args, gain=GAIN), "pi": dict(pi_args)}[rule]
    ctl = EntropyController(target, knob, args.pop("init"), rule=rule, **args)
    run = simulate(TabularProblem.random(seed=seed), DynamicsConfig(steps=steps, mode=mode, seed=seed,
                                                                   entropy_control=ctl))
    tail = run.entropy[-100:]
    return {"settle_step": settle_step(run.entropy, target), "tail_abs_error": float(np.abs(tail - target).mean()),
            "tail_signed_error": float((target - tail).mean()),
            "tail_max_error": float(np.abs(tail - target).max()), "final_accuracy": float(run.accuracy[-1]),
            "final_value": ctl.value}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, nargs="+", default=[TARGET], help="target entropies (nats)")
    parser.add_argument("--out", default="bench/results")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    baseline = [simulate(TabularProblem.random(seed=s), DynamicsConfig(steps=opts.steps, seed=s)) for s in opts.seeds]
    rows = []
    for target in opts.target:
        for knob in KNOB_SETTINGS:
            for rule in RULES:
                runs = [run_one(knob, rule, s, opts.steps, target) for s in opts.seeds]
                rows.append({"target": target, "knob": knob, "rule": rule,
                             **{k: float(np.mean([r[k] for r in runs])) for k in runs[0]}})
    doc = {"targets": opts.target, "steps": opts.steps, "seeds": opts.seeds, "gain": GAIN, "settings": KNOB_SETTINGS,
           "uncontrolled_final_entropy": float(np.mean([b.entropy[-1] for b in baseline])),
           "uncontrolled_final_accuracy": float(np.mean([b.accuracy[-1] for b in baseline])),
           "rows": rows, "seconds": time.perf_counter() - t0}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "entropy-controllers-tabular.json").write_text(json.dumps(doc, indent=1))
    lines = [f"Targets {opts.target} nats, {opts.steps} steps, seeds {opts.seeds} (mean); uncontrolled GRPO ends at "
             f"H = {doc['uncontrolled_final_entropy']:.3f}, accuracy {doc['uncontrolled_final_accuracy']:.3f}.", "",
             "| target | knob | rule | settles at step | mean abs(H - target), last 100 | mean target - H, last 100 | "
             "max, last 100 | final value | final accuracy |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']:g} | {r['knob']} | {r['rule']} | {r['settle_step']:.0f} | "
                     f"{r['tail_abs_error']:.4f} | {r['tail_signed_error']:+.4f} | {r['tail_max_error']:.4f} | "
                     f"{r['final_value']:.4g} | {r['final_accuracy']:.3f} |")
    (out / "entropy-controllers-tabular.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
