"""The trainer's entropy controls: algo.entropy_control (checkpointed, logged, resumed bit-exact),
algo.entropy_advantage (Cheng et al.'s shaping), the one-line warning for on-policy KL-Cov, their config errors.
The controller on 2 ranks: tests/trainer/e2e/test_entropy_control_trainer_e2e.py."""

import warnings

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import _fixtures
from _fixtures import ROOT, TINY, stable

from fastcov.trainer import controls
from fastcov.trainer import train as train_mod
from fastcov.trainer.config import ConfigError, load_config
from fastcov.trainer.runtime.batch import Sequence
from fastcov.trainer.runtime.run_dir import read_metrics

pytestmark = pytest.mark.usefixtures("varied_rewards")  # tests/trainer/conftest.py


def tiny(tmp_path, name, *overrides):  # the shared one, without evaluation
    return _fixtures.tiny(tmp_path, name, "trainer.eval_every=0", *overrides)


def test_controller_resumes_bit_exact_and_follows_its_rule(tmp_path):
    # an untrained tiny model's entropy is ~log V: a target above it makes the bonus grow, gated TRL-style
    over = ["trainer.max_steps=4", "trainer.save_every=2", "algo.entropy_control.target=50.0",
            "algo.entropy_control.delta=0.02", "algo.entropy_control.init=0.01", "algo.entropy_control.gate=true",
            "algo.entropy_control.inclusive=true"]
    full = train_mod.train(tiny(tmp_path, "full", *over))
    cut = tiny(tmp_path, "cut", *over)
    train_mod.train(cut, stop_at=2)
    train_mod.train(cut, resume=True)
    a = stable(read_metrics(full / "metrics.jsonl"))
    b = stable(read_metrics(tmp_path / "cut" / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a == b
    values = [r["entropy_control/value"] for r in a]
    # step 1: no measurement yet, the gate holds the bonus off; then 0.01 + 0.02 per step (H <= target)
    assert values == pytest.approx([0.0, 0.03, 0.05, 0.07], abs=1e-12)
    assert all(r["entropy_control/error"] == pytest.approx(50.0 - r["entropy"]) for r in a)
    assert all(r["entropy_control/target"] == 50.0 for r in a)


def test_pi_rule_with_a_relative_target_in_the_loop_follows_its_rule_and_resumes_bit_exact(tmp_path):
    """algo.entropy_control with rule pi on KL-Cov's β and target "0.9x" over a 2-step window: the first two steps
    train with β = init and log no target; from step 2 on the target is 0.9 × their mean entropy and β follows
    init + kp·e + ki·Σe, e = (T − H)/T, clipped to [0, 10]; a run cut at step 2 (the window's end) resumes with
    the same numbers."""
    over = ["trainer.max_steps=4", "trainer.save_every=2", "algo.mode=kl_cov", "algo.entropy_control.target=0.9x",
            "algo.entropy_control.window=2", "algo.entropy_control.knob=kl_cov_coef", "algo.entropy_control.rule=pi",
            "algo.entropy_control.init=1.0", "algo.entropy_control.kp=2.0", "algo.entropy_control.ki=0.5",
            "algo.entropy_control.max=10.0"]
    full = train_mod.train(tiny(tmp_path, "full", *over))
    cut = tiny(tmp_path, "cut", *over)
    train_mod.train(cut, stop_at=2)
    train_mod.train(cut, resume=True)
    a = stable(read_metrics(full / "metrics.jsonl"))
    assert a == stable(read_metrics(tmp_path / "cut" / "metrics.jsonl"))
    hs = [r["entropy"] for r in a]
    target = 0.9 * (hs[0] + hs[1]) / 2
    assert "entropy_control/target" not in a[0] and a[1]["entropy_control/target"] == pytest.approx(target)
    beta, integral = [1.0, 1.0], 0.0
    for h in hs[1:3]:  # the rule acts from step 2 (the window's last) on: β for steps 3 and 4
        e = (target - h) / target
        integral += e  # the bounds are not reached here: β stays inside (0, 10) (checked below)
        beta.append(1.0 + 2.0 * e + 0.5 * integral)
    assert all(0.0 < b < 10.0 for b in beta)
    assert [r["entropy_control/value"] for r in a] == pytest.approx(beta, rel=1e-12)


def test_a_controller_that_never_moves_changes_no_number(tmp_path):
    """The controlled path (LossConfig rebuilt with the knob) with delta 0 and the configured value equals the run
    without a controller: the controller adds arithmetic only through the knob."""
    over = ["trainer.max_steps=2", "algo.mode=kl_cov"]
    plain = stable(read_metrics(train_mod.train(tiny(tmp_path, "plain", *over)) / "metrics.jsonl"))
    held = stable(read_metrics(train_mod.train(tiny(
        tmp_path, "held", *over, "algo.entropy_control.target=1.0", "algo.entropy_control.knob=kl_cov_coef",
        "algo.entropy_control.delta=0.0")) / "metrics.jsonl"))
    extra = {"entropy_control/value", "entropy_control/error", "entropy_control/target"}
    assert [{k: v for k, v in r.items() if k not in extra} for r in held] == plain
    assert [r["entropy_control/value"] for r in held] == [1.0, 1.0]


def test_entropy_advantage_shapes_and_logs(tmp_path):
    over = ["trainer.max_steps=1", "algo.mode=vanilla"]
    plain = read_metrics(train_mod.train(tiny(tmp_path, "plain", *over)) / "metrics.jsonl")[-1]
    shaped = read_metrics(train_mod.train(tiny(tmp_path, "shaped", *over, "algo.entropy_advantage.alpha=0.1"))
                          / "metrics.jsonl")[-1]
    assert shaped["entropy_advantage/bonus"] > 0 and "entropy_advantage/bonus" not in plain
    assert shaped["entropy"] == plain["entropy"] and shaped["loss"] != plain["loss"]


def test_shape_advantages_on_sequences():
    cfg = load_config(TINY, ["algo.entropy_advantage.alpha=0.3", "algo.entropy_advantage.kappa=2.0"])
    gen = torch.Generator().manual_seed(4)
    seqs = []
    for i in range(4):
        n = 3 + i
        s = Sequence([1, 2], list(range(n)), [0.0] * n, group=i, advantage=float(torch.randn(1, generator=gen)))
        s.old_entropy = (torch.rand(n, generator=gen) * 2).tolist()
        if i == 3:
            s.token_advantages = torch.randn(n, generator=gen).tolist()  # token-level (REINFORCE++ KL, PRIME)
        seqs.append(s)
    before = [list(s.token_advantages) if s.token_advantages else [s.advantage] * len(s.response) for s in seqs]
    sums = controls.shape_advantages(seqs, cfg.algo)
    total = 0.0
    for s, adv in zip(seqs, before, strict=True):
        want = [a + min(0.3 * h, abs(a) / 2.0) for a, h in zip(adv, s.old_entropy, strict=True)]
        assert s.token_advantages == pytest.approx(want, rel=1e-6, abs=1e-7)
        total += sum(w - a for w, a in zip(want, adv, strict=True))
    n = sum(len(s.response) for s in seqs)
    assert sums["entropy_advantage/bonus"] == pytest.approx(total / n, rel=1e-5)


@pytest.mark.parametrize("over, warned", [
    (["algo.mode=kl_cov", "algo.mini_batches=1"], True),
    (["algo.mode=kl_cov", "algo.mini_batches=2"], False),
    (["algo.mode=kl_cov", "algo.mini_batches=1", "algo.ppo_epochs=2"], False),
    (["algo.mode=clip_cov", "algo.mini_batches=1"], False),
])
def test_on_policy_kl_cov_warns_once_in_one_line(over, warned):
    cfg = load_config(TINY, over)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        controls.start_controls(cfg.algo, rank=0)
        controls.start_controls(cfg.algo, rank=1)  # only rank 0 says it
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == int(warned)
    if warned:
        assert "\n" not in msgs[0] and "algo.mini_batches" in msgs[0] and "algo.ppo_epochs" in msgs[0]


@pytest.mark.parametrize("over, key", [
    (["algo.entropy_control.target=0.3"], "algo.entropy_control.delta"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.knob=kl_cov_coef"],
     "algo.entropy_control.knob"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.rule=proportional"], "algo.entropy_control.min"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.knob=pos_weight",
      "algo.pos_weight.enabled=true"], "algo.entropy_control.knob"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.knob=clip_cov_ratio",
      "algo.entropy_control.gate=true"], "algo.entropy_control.gate"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.init=2.0"],
     "algo.entropy_control.init"),
    (["algo.entropy_control.tagret=0.3"], "algo.entropy_control.target"),
    (["algo.entropy_control.target=-0.3", "algo.entropy_control.delta=0.1"], "algo.entropy_control.target"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.rule=proportional", "algo.entropy_control.min=0.01",
      "algo.entropy_control.gain=0"], "algo.entropy_control.gain"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.max=-1.0"],
     "algo.entropy_control.max"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.min=0.5",
      "algo.entropy_control.max=0.2"], "algo.entropy_control.min"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.rule=pi", "algo.entropy_control.ki=0.1"],
     "algo.entropy_control.kp"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.rule=pi", "algo.entropy_control.kp=1.0"],
     "algo.entropy_control.ki"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.rule=pi", "algo.entropy_control.kp=1.0",
      "algo.entropy_control.ki=0.1", "algo.entropy_control.integral_max=-1"], "algo.entropy_control.integral_max"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.kp=1.0"],
     "algo.entropy_control.kp"),
    (["algo.entropy_control.target=0.75y", "algo.entropy_control.delta=0.1"], "algo.entropy_control.target"),
    (["algo.entropy_control.target=0.75x", "algo.entropy_control.delta=0.1", "algo.entropy_control.window=0"],
     "algo.entropy_control.window"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.window=4"],
     "algo.entropy_control.window"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.target_end=0.2"],
     "algo.entropy_control.target_steps"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.target_end=x",
      "algo.entropy_control.target_steps=[0,10]"], "algo.entropy_control.target_end"),
    (["algo.entropy_control.target=0.3", "algo.entropy_control.delta=0.1", "algo.entropy_control.target_end=0.2",
      "algo.entropy_control.target_steps=[10,5]"], "algo.entropy_control.target_steps"),
    (["algo.entropy_advantage.alpha=-1"], "algo.entropy_advantage.alpha"),
    (["algo.entropy_advantage.kappa=0"], "algo.entropy_advantage.kappa"),
])
def test_bad_config_names_the_key(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        load_config(TINY, over)
    assert "\n" not in str(info.value)


def test_the_controllers_study_loads_every_arm():
    """configs/studies/controllers.yaml (make study-controllers): every arm is a valid run config."""
    from fastcov.trainer.experiments.study import load_study

    study = load_study(ROOT / "configs" / "studies" / "controllers.yaml")
    for name, over in study["arms"].items():
        cfg = load_config(ROOT / "configs" / "demo.yaml", list(study["common"]) + list(over))
        assert (cfg.algo.entropy_control.target is not None) == ("entropy_control" in " ".join(over)), name
        controller = controls.start_controls(cfg.algo, rank=1).entropy
        assert controller is None or cfg.algo.entropy_control.target == study["target"]
    # the arms issue 60 names, each with what makes it that arm, at the demo's size
    wanted = {"grpo": ["algo.mode=vanilla"], "kl_cov": ["algo.mode=kl_cov"], "clip_cov": ["algo.mode=clip_cov"],
              "bonus_adaptive": ["knob=entropy_coef", "delta=0.005", "gate=true", "inclusive=true"],
              "kl_cov_beta_step": ["knob=kl_cov_coef", "delta=0.25"],
              "kl_cov_beta_pi": ["knob=kl_cov_coef", "rule=pi", "kp=", "ki="],
              "pos_weight_pi": ["algo.mode=vanilla", "knob=pos_weight", "rule=pi", "kp=", "ki="]}
    assert set(study["arms"]) == set(wanted) and study["seeds"] == [0, 1, 2]
    for arm, markers in wanted.items():
        assert all(m in " ".join(study["arms"][arm]) for m in markers), arm
    common = " ".join(study["common"])
    assert "trainer.max_steps=200" in common and "trainer.prompts_per_step=16" in common
