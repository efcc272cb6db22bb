"""The study runner (trainer/experiments/study.py) on the demo task at a tiny size, end to end: Jin et al.'s three
arms, several seeds with intervals and the entropy law, the selection study's section; --report-only writes the same
report again (the study files, the resume and the controllers' study: tests/trainer/experiments/test_study.py)."""

import json

import pytest
from _fixtures import ROOT, TINY_STUDY_RUNS, TINY_STUDY_SETUP


@pytest.mark.slow
def test_study_runs_three_arms_and_reports(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer.experiments.study import main

    study_file = ROOT / "configs" / "studies" / "jin-reweight.yaml"
    rc = main([str(study_file), "--out", str(tmp_path), *TINY_STUDY_SETUP,
               "trainer.max_steps=1", "trainer.prompts_per_step=4", "rollout.n=4", "algo.mini_batches=2",
               "trainer.eval_every=1", "trainer.eval_k=2", "rollout.max_new_tokens=12", "trainer.progress=false"])
    assert rc == 0
    text = (tmp_path / "report.md").read_text()
    for arm in ("grpo", "grpo_reweight", "kl_cov"):
        assert f"| {arm} |" in text
    assert "pass@2" in text and (tmp_path / "reliability.png").is_file()
    rows = [json.loads(ln) for ln in (tmp_path / "grpo_reweight" / "metrics.jsonl").read_text().splitlines()]
    lams = [r["lambda"] for r in rows if "lambda" in r]
    # the re-weighting arm starts at lambda 0 (its steps: test_study.py::test_study_file_carries_the_paper_values)
    assert lams == [0.0]
    assert all(r.get("lambda") == 1.0 for r in
               [json.loads(ln) for ln in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()] if "lambda" in r)


@pytest.mark.slow
def test_multi_seed_study_reports_intervals_and_the_law(tmp_path):
    """configs/studies/entropy-control.yaml's arms x 2 seeds at a tiny size: every arm/seed trains, and the
    report carries mean ± CI, the gap to GRPO, the selection table and the law holdout."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer.experiments.study import load_study, main

    study_file = ROOT / "configs" / "studies" / "entropy-control.yaml"
    study = load_study(study_file)
    assert study["seeds"] == [0, 1, 2] and set(study["arms"]) == {"grpo", "clip_cov", "kl_cov", "kl_cov_beta0",
                                                                 "kl_cov_random"}
    rc = main([str(study_file), "--out", str(tmp_path), *TINY_STUDY_SETUP, "--seeds", "0,1",
               "--arms", "grpo,kl_cov_random", "trainer.max_steps=20", "trainer.eval_every=20", *TINY_STUDY_RUNS])
    assert rc == 0
    text = (tmp_path / "report.md").read_text()
    assert "| grpo | 2 |" in text and "| kl_cov_random | 2 |" in text and " ± " in text
    assert "kl_cov_random − grpo, final entropy" in text and "Entropy law on grpo" in text
    summary = json.loads((tmp_path / "study.json").read_text())
    assert summary["seeds"] == [0, 1] and set(summary["runs"]) == {"grpo/seed0", "grpo/seed1", "kl_cov_random/seed0",
                                                                   "kl_cov_random/seed1"}
    m0 = (tmp_path / "grpo" / "seed0" / "metrics.jsonl").read_text()
    m1 = (tmp_path / "grpo" / "seed1" / "metrics.jsonl").read_text()
    assert m0 != m1, "seeds must change the run"
    assert (tmp_path / "entropy_bands.png").is_file()
    # the start model and every run evaluated on the problems with one operation more, in their own table
    harder = json.loads((tmp_path / "kl_cov_random" / "seed1" / "harder_eval.json").read_text())
    assert harder["seed"] == 1 and harder["start"]["prompts"] == harder["end"]["prompts"] == 4
    assert "Held-out problems with one operation more than any training problem (4 prompts" in text
    assert set(summary["harder"]["arms"]) == {"grpo", "kl_cov_random"}
    assert (tmp_path / "harder.png").is_file() and "![problems with one operation more](harder.png)" in text
    # --report-only trains nothing and writes the same report again, keeping the recorded wall time
    (tmp_path / "report.md").unlink()
    metrics_before = m0
    rc = main([str(study_file), "--out", str(tmp_path), "--seeds", "0,1", "--arms", "grpo,kl_cov_random",
               "--report-only"])
    assert rc == 0 and (tmp_path / "report.md").read_text() == text
    assert (tmp_path / "grpo" / "seed0" / "metrics.jsonl").read_text() == metrics_before
    assert main([str(study_file), "--out", str(tmp_path / "none"), "--seeds", "0", "--report-only"]) == 2


@pytest.mark.slow
def test_selection_study_smoke_reports_the_selection_section(tmp_path):
    """One seed of three arms at a tiny size: the per-seed layout, the selection section and its plot, the
    random control's overlap metric, and --report-only writing the same report from the cached runs."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from fastcov.trainer.experiments.study import main

    study_file = ROOT / "configs" / "studies" / "selection.yaml"
    args = [str(study_file), "--out", str(tmp_path), "--seeds", "0", "--arms", "grpo,clip_cov,clip_cov_random"]
    rc = main(args + [*TINY_STUDY_SETUP, "trainer.max_steps=3", "trainer.eval_every=3", *TINY_STUDY_RUNS,
                      "algo.loss.clip_cov_ratio=0.2", "algo.loss.clip_cov_lb=-10.0"])
    assert rc == 0
    text = (tmp_path / "report.md").read_text()
    assert "## Selection − random, per ratio" in text and "| clip_cov | 0.2 | 2 |" in text
    assert "With one seed per arm there are no intervals" in text and (tmp_path / "selection.png").is_file()
    rows = [json.loads(ln) for ln in (tmp_path / "clip_cov_random" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["sel/jaccard_vs_cov"] <= 1 for r in rows if r.get("selected_frac"))
    summary = json.loads((tmp_path / "study.json").read_text())
    tokens = summary["selection"][0]["tokens"]  # the band holds every token: both detach k = ⌊0.2·n⌋ per update
    assert tokens["arm"]["mean"] > 0 and tokens["control"]["mean"] > 0
    (tmp_path / "report.md").unlink()
    assert main(args + ["--report-only"]) == 0 and (tmp_path / "report.md").read_text() == text
