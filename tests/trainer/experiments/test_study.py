"""Jin et al.'s re-weighting knobs in the config, the study files and their checks, and the study runner on the demo
task at a tiny size (the controllers' study, --resume). Longer studies end to end:
tests/trainer/e2e/test_study_e2e.py."""

import json
from pathlib import Path

import pytest
from _fixtures import TINY_STUDY_RUNS, TINY_STUDY_SETUP

ROOT = Path(__file__).resolve().parents[3]
STUDY = ROOT / "configs" / "studies" / "jin-reweight.yaml"


def test_study_file_carries_the_paper_values():
    from fastcov.trainer.config import load_config, positive_weight_schedule
    from fastcov.trainer.experiments.study import load_study

    study = load_study(STUDY)
    assert list(study["arms"]) == ["grpo", "grpo_reweight", "kl_cov"]
    cfg = load_config(ROOT / study["base"], ["model.path=/m"] + study["common"] + study["arms"]["grpo_reweight"])
    a = cfg.algo
    p = a.pos_weight
    assert p.enabled and (p.init, p.target_entropy, p.delta) == (0.0, 0.2, 0.05)
    sched = positive_weight_schedule(a)
    assert sched.value == 0.0
    assert sched.step(entropy=0.3) == pytest.approx(0.05)  # H >= delta: lambda grows by Delta
    assert sched.step(entropy=0.1) == pytest.approx(0.0)  # H < delta: it shrinks, clipped at 0


def test_study_contrasts_name_two_of_its_arms(tmp_path):
    from fastcov.cli import UserError
    from fastcov.trainer.experiments.study import load_study

    study = load_study(ROOT / "configs" / "studies" / "entropy-control.yaml")
    assert "kl_cov - kl_cov_random" in study["contrasts"]
    for bad in ('["kl_cov - nope"]', '["kl_cov"]', "[3]"):
        path = tmp_path / "s.yaml"
        path.write_text(f"arms: {{kl_cov: [algo.mode=kl_cov], grpo: [algo.mode=vanilla]}}\ncontrasts: {bad}\n")
        with pytest.raises(UserError, match="contrasts"):
            load_study(path)


def test_study_task_sets_the_demo_problems_and_warm_start(tmp_path, monkeypatch):
    """``task:`` reaches the task writer and the warm-start (recorded, not run); bad values name the key."""
    from types import SimpleNamespace

    from fastcov.cli import UserError
    from fastcov.trainer.experiments import demo
    from fastcov.trainer.experiments.study import _demo_setup, load_study

    study = load_study(ROOT / "configs" / "studies" / "hard-task.yaml")
    assert study["task"] == {"max_ops": 3, "max_value": 9, "style_weights": [0.05, 0.05, 0.45, 0.45]}
    assert load_study(STUDY)["task"] == {"max_ops": 2, "max_value": 9, "style_weights": [0.25] * 4}
    calls = {}
    monkeypatch.setattr(demo, "write_task", lambda d, n_train, n_val, max_ops, max_value, seed:
                        calls.setdefault("write", (n_train, n_val, max_ops, max_value)))
    monkeypatch.setattr(demo, "warm_start", lambda d, data, scfg, max_ops, max_value:
                        calls.setdefault("warm", (scfg.steps, scfg.style_weights, max_ops, max_value)))
    args = SimpleNamespace(report_only=False, reuse_sft=False, sft_steps=7, n_train=64, n_val=5)
    over = _demo_setup(tmp_path, args, study["task"])
    assert calls == {"write": (64, 5, 3, 9), "warm": (7, (0.05, 0.05, 0.45, 0.45), 3, 9)}
    assert over[0] == f"model.path={tmp_path / 'sft' / 'model'}"
    arms = "arms: {grpo: [algo.mode=vanilla]}\n"
    for bad, key in (("setup: demo\ntask: {max_ops: 0}", "task.max_ops"),
                     ("setup: demo\ntask: {style_weights: [1, 1]}", "task.style_weights"),
                     ("setup: demo\ntask: {style_weights: [0, 0, 0, 0]}", "task.style_weights"),
                     ("setup: demo\ntask: {ops: 3}", "unknown task key 'ops'"),
                     ("setup: none\ntask: {max_ops: 3}", "setup: demo only")):
        path = tmp_path / "s.yaml"
        path.write_text(arms + bad + "\n")
        with pytest.raises(UserError, match=key):
            load_study(path)


def test_last_step_reads_the_newest_complete_row_of_this_run(tmp_path):
    import time

    from fastcov.trainer.experiments.runs import _last_step

    m = tmp_path / "metrics.jsonl"
    assert _last_step(m, 0.0) == 0  # not written yet
    m.write_text('{"step": 0}\n{"step": 1, "entropy": 0.3}\n{"step": 2, "ent')  # a torn last line
    assert _last_step(m, 0.0) == 1
    assert _last_step(m, time.time() + 60) == 0  # older than the watch: an earlier run's file


SELECTION = ROOT / "configs" / "studies" / "selection.yaml"


def test_selection_study_pairs_each_method_with_its_random_control():
    """configs/studies/selection.yaml (issue 34): KL-Cov at 0.05-0.5 against cov_score=random, Clip-Cov at the
    demo's setting against cov_score=random_matched, each pair alike but for the score; GRPO; 3 seeds; the
    demo's task and evaluation."""
    from fastcov.trainer.config import load_config
    from fastcov.trainer.experiments.study import _selection_pairs, load_study

    study = load_study(SELECTION)
    control = load_study(ROOT / "configs" / "studies" / "entropy-control.yaml")
    assert study["seeds"] == [0, 1, 2] and study["setup"] == "demo" and study["common"] == control["common"]
    assert study["task"] == control["task"] and study["arms"]["grpo"] == ["algo.mode=vanilla"]
    demo = load_config(ROOT / "configs" / "demo.yaml", ["model.path=/m"])
    seeds = study["seeds"]
    cfgs = {(a, sd): load_config(ROOT / study["base"], ["model.path=/m"] + study["common"] + over)
            for a, over in study["arms"].items() for sd in seeds}
    pairs = _selection_pairs(study, list(study["arms"]), seeds, cfgs)
    assert len(pairs) == len(study["selection_contrasts"]) == 6
    for p in pairs:
        arm, ctrl = cfgs[(p["arm"], 0)], cfgs[(p["control"], 0)]
        assert arm.algo.loss.cov_score == "batch" and ctrl.algo.loss.cov_score == p["control_score"]
        assert p["control_score"] == {"kl_cov": "random", "clip_cov": "random_matched"}[p["method"]]
        # the pair differs in the score only
        assert ctrl == load_config(ROOT / study["base"], ["model.path=/m"] + study["common"] + study["arms"][p["arm"]]
                                   + [f"algo.loss.cov_score={p['control_score']}"])
    kl = sorted((p["ratio"], p["prompts"]) for p in pairs if p["method"] == "kl_cov")
    assert kl == [(0.05, 16), (0.05, 32), (0.1, 16), (0.2, 16), (0.5, 16)]
    clip = [p for p in pairs if p["method"] == "clip_cov"]
    assert [(p["ratio"], p["prompts"]) for p in clip] == [(demo.algo.loss.clip_cov_ratio, demo.trainer.prompts_per_step)]
    assert _selection_pairs(study, ["grpo", "clip_cov", "clip_cov_random"], seeds, cfgs)[0]["arm"] == "clip_cov"


def test_selection_contrasts_name_two_of_its_arms(tmp_path):
    from fastcov.cli import UserError
    from fastcov.trainer.experiments.study import load_study

    path = tmp_path / "s.yaml"
    path.write_text("arms: {kl_cov: [algo.mode=kl_cov]}\nselection_contrasts: ['kl_cov - kl_cov_random']\n")
    with pytest.raises(UserError, match="selection_contrasts entries are 'ARM - ARM'"):
        load_study(path)


def test_controllers_study_smoke_reports_how_each_arm_holds_the_target(tmp_path):
    """configs/studies/controllers.yaml at a tiny size, 2 arms x 2 seeds: the report's target section (error,
    share within 10%, first arrival per seed) and the panel plot, and the controller's value in the numbers."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer.experiments.study import main

    study_file = ROOT / "configs" / "studies" / "controllers.yaml"
    rc = main([str(study_file), "--out", str(tmp_path), *TINY_STUDY_SETUP, "--seeds", "0,1",
               "--arms", "grpo,bonus_adaptive", "trainer.max_steps=6", "trainer.eval_every=6", *TINY_STUDY_RUNS])
    assert rc == 0
    text = (tmp_path / "report.md").read_text()
    assert "How each arm holds the target 0.25 nats/token" in text
    assert "| bonus_adaptive |" in text and "bonus_adaptive − grpo, mean abs(H − target)" in text
    assert "; share within 10%: " in text
    assert "![entropy against the target](entropy_target.png)" in text and (tmp_path / "entropy_target.png").is_file()
    # the headline figure: the study's headline arms that ran (grpo; kl_cov did not) and the best controller
    assert "was lowest: **bonus_adaptive**" in text and (tmp_path / "entropy_headline.png").is_file()
    assert "![grpo, bonus_adaptive against the target](entropy_headline.png)" in text
    summary = json.loads((tmp_path / "study.json").read_text())
    assert summary["best_controller"] == "bonus_adaptive"
    assert "share_within_10pct_gap" in summary["target_holding"]["arms"]["bonus_adaptive"]
    held = summary["target_holding"]
    assert held["target"] == 0.25 and set(held["arms"]) == {"grpo", "bonus_adaptive"}
    assert len(held["arms"]["grpo"]["first_step_within_10pct"]) == 2
    values = [json.loads(line).get("entropy_control/value")
              for line in (tmp_path / "bonus_adaptive" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert any(v is not None for v in values)
    # the curves behind the figures, one CSV row per run and step, the controller's value where it has one
    import csv

    rows = list(csv.DictReader((tmp_path / "curves.csv").open()))
    assert len(rows) == 4 * 6 and {(r["arm"], r["seed"]) for r in rows} == {
        (a, s) for a in ("grpo", "bonus_adaptive") for s in ("0", "1")}
    assert all(r["control_value"] == "" for r in rows if r["arm"] == "grpo")
    assert [float(r["control_value"]) for r in rows if r["arm"] == "bonus_adaptive" and r["seed"] == "0"] == [
        pytest.approx(v, rel=1e-5) for v in values if v is not None]  # written with 6 significant digits


def test_resume_keeps_finished_runs_and_trains_the_rest(tmp_path):
    """--resume after a stopped study: finished runs (and their harder-split evaluations) are kept untouched, a
    missing run and a finished run with other settings are trained, and the report says so."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    import yaml

    from fastcov.trainer.experiments.study import main

    study_file = ROOT / "configs" / "studies" / "controllers.yaml"
    args = [str(study_file), "--out", str(tmp_path), "--seeds", "0,1", "--arms", "grpo,bonus_adaptive",
            "trainer.max_steps=3", "trainer.eval_every=3", *TINY_STUDY_RUNS]
    assert main([*args[:3], *TINY_STUDY_SETUP, *args[3:]]) == 0

    def stamp(run: str) -> tuple:
        d = tmp_path / run
        return tuple((d / f).stat().st_mtime_ns for f in ("metrics.jsonl", "harder_eval.json", "final/config.json"))

    kept = {run: stamp(run) for run in ("grpo/seed0", "grpo/seed1", "bonus_adaptive/seed0")}
    # the study was stopped before bonus_adaptive/seed1 ran, and grpo/seed1 had been trained with another beta
    (tmp_path / "bonus_adaptive" / "seed1").rename(tmp_path / "stopped")
    recorded = yaml.safe_load((tmp_path / "grpo" / "seed1" / "config.yaml").read_text())
    recorded["algo"]["loss"]["kl_cov_coef"] += 1.0
    (tmp_path / "grpo" / "seed1" / "config.yaml").write_text(yaml.safe_dump(recorded))
    assert main(args + ["--reuse-sft", "--resume"]) == 0
    assert stamp("grpo/seed0") == kept["grpo/seed0"] and stamp("bonus_adaptive/seed0") == kept["bonus_adaptive/seed0"]
    assert stamp("grpo/seed1") != kept["grpo/seed1"]  # trained again: its settings were not the study's
    assert (tmp_path / "bonus_adaptive" / "seed1" / "harder_eval.json").is_file()
    text = (tmp_path / "report.md").read_text()
    assert "Resumed (--resume): 2 of 4 runs were trained by an earlier invocation and kept" in text
    assert set(json.loads((tmp_path / "study.json").read_text())["runs"]) == {
        "grpo/seed0", "grpo/seed1", "bonus_adaptive/seed0", "bonus_adaptive/seed1"}
