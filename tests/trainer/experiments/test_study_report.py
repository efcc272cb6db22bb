"""The study's report: the tables from per-seed runs, the selection and controller sections (Student's t and the
intervals: test_student_t.py)."""

import math

import pytest

from fastcov.trainer.experiments.student_t import diff_ci
from fastcov.trainer.experiments.study_report import study_tables


def _run(start, end, passk, steps=40, seed=0):
    import random

    rng = random.Random(seed)
    end = end + rng.uniform(-0.03, 0.03)  # seed-to-seed spread of where a run ends
    ent = [start + (end - start) * i / (steps - 1) + rng.uniform(-0.005, 0.005) for i in range(steps)]
    acc = [0.5 + 0.3 * (1 - math.exp(h - start)) + rng.uniform(-0.01, 0.01) for h in ent[::4]]
    rollout_acc = [0.5 + 0.3 * (1 - math.exp(h - start)) + rng.uniform(-0.01, 0.01) for h in ent]
    return {"steps": list(range(1, steps + 1)), "entropy": ent, "rollout_acc": rollout_acc, "eval_steps": list(range(1, steps + 1, 4)),
            "val_acc": acc, "start_entropy": ent[0], "final_entropy": sum(ent[-4:]) / 4, "final_val_acc": acc[-1],
            "pass@8": passk + rng.uniform(-0.01, 0.01), "mean@8": passk - 0.1, "start_pass@8": 0.9 + seed % 3 * 0.01,
            "start_mean@8": 0.6, "distinct_answers": 1.0 + 4 * end + rng.uniform(-0.05, 0.05),
            "start_distinct_answers": 3.0 + rng.uniform(-0.05, 0.05), "selected_tokens": None, "selected_pos_adv_share": None, "selected_prob": None,
            "selected_cov": None}


def test_study_tables_say_whether_the_gap_excludes_zero():
    numbers = {"grpo": [_run(0.4, 0.15, 0.8, seed=s) for s in range(3)],
               "kl_cov": [_run(0.4, 0.35, 0.82, seed=10 + s) for s in range(3)]}
    lines, summary = study_tables(numbers, 8)
    text = "\n".join(lines)
    assert "| grpo | 3 |" in text and "| kl_cov | 3 |" in text
    gap = summary["arms"]["kl_cov"]["entropy_gap"]
    assert gap["mean"] == pytest.approx(0.2, abs=0.04) and gap["excludes_zero"]
    assert "the interval excludes 0" in text
    means = {a: sum(r["final_entropy"] for r in numbers[a]) / 3 for a in numbers}
    assert summary["arms"]["kl_cov"]["entropy_ratio_to_baseline"] == pytest.approx(means["kl_cov"] / means["grpo"])
    assert "Entropy law on grpo" in text and "holdout RMSE" in text
    # kl_cov's pass@8 is 0.02 above grpo's with a spread of 0.01: the pass@8 gap is stated with its interval
    pgap = summary["arms"]["kl_cov"]["pass@8_gap"]
    assert pgap["mean"] == pytest.approx(0.02, abs=0.015) and pgap["ci95"] > 0
    assert f"kl_cov − grpo, final entropy: {gap['mean']:.3f} ± {gap['ci95']:.3f}" in text and "; pass@8: " in text
    assert summary["start"]["pass@8"]["mean"] == pytest.approx(0.91, abs=1e-9)
    assert "the start model (step 0, every run's first evaluation): pass@8 0.910 ± " in text
    assert "mean@8 0.600 ± 0.000, 3.00 ± 0.0" in text  # the start's distinct answers per prompt
    # the table's last column: distinct answers per prompt at the end, ~1 + 4 x end entropy here
    grpo_row = next(ln for ln in lines if ln.startswith("| grpo |"))
    d = summary["arms"]["grpo"]["distinct_answers"]
    assert d["mean"] == pytest.approx(1.6, abs=0.15) and grpo_row.endswith(f"| {d['mean']:.2f} ± {d['ci95']:.2f} |")
    # mean@8 is 0.02 apart with no spread: its gap is stated beside pass@8's
    mgap = summary["arms"]["kl_cov"]["mean@8_gap"]
    assert mgap["mean"] == pytest.approx(0.02, abs=1e-9) and "; mean@8: 0.020" in text
    # every run's pass@8 is ~0.8 after a start of 0.90-0.92: the change is negative and stated with its interval
    change = summary["arms"]["grpo"]["pass@8_change"]
    assert change["mean"] == pytest.approx(0.8 - 0.91, abs=0.015) and change["ci95"] > 0
    assert f"- grpo, end − start of the same run: pass@8 {change['mean']:.3f} ± {change['ci95']:.3f} (the interval excludes 0)" in text
    # a contrast between two arms is stated like the gaps to GRPO, under its own key
    with_control = dict(numbers, kl_cov_random=[_run(0.4, 0.25, 0.8, seed=30 + s) for s in range(3)])
    lines2, summary2 = study_tables(with_control, 8, contrasts=[("kl_cov", "kl_cov_random")])
    c = summary2["arms"]["kl_cov"]["entropy_gap_vs_kl_cov_random"]
    assert c["mean"] == pytest.approx(0.1, abs=0.04) and c["excludes_zero"]
    assert summary2["arms"]["kl_cov"]["entropy_gap"] == gap  # the gap to GRPO is unchanged
    assert f"- kl_cov − kl_cov_random, final entropy: {c['mean']:.3f} ± {c['ci95']:.3f}" in "\n".join(lines2)
    same = {"grpo": numbers["grpo"], "kl_cov": [_run(0.4, 0.15, 0.8, seed=20 + s) for s in range(3)]}
    assert not study_tables(same, 8)[1]["arms"]["kl_cov"]["entropy_gap"]["excludes_zero"]


def _harder(start_p8, end_p8, end_m8, seed):
    import random

    rng = random.Random(seed)
    end = {"prompts": 64, "pass@8": end_p8 + rng.uniform(-0.02, 0.02), "mean@8": end_m8 + rng.uniform(-0.02, 0.02),
           "distinct_answers": 1.5 + rng.uniform(-0.1, 0.1)}
    start = {"prompts": 64, "pass@8": start_p8, "mean@8": 0.19, "distinct_answers": 3.6}
    return {"k": 8, "temperature": 0.6, "start": start, "end": end}


def test_harder_split_section_gives_changes_and_gaps_with_intervals():
    numbers = {"grpo": [dict(_run(0.4, 0.1, 0.9, seed=s), harder=_harder(0.6, 0.25, 0.14, s)) for s in range(3)],
               "clip_cov": [dict(_run(0.4, 0.2, 0.9, seed=5 + s), harder=_harder(0.6, 0.55, 0.33, 5 + s))
                            for s in range(3)]}
    lines, summary = study_tables(numbers, 8)
    text = "\n".join(lines)
    assert "Held-out problems with one operation more than any training problem (64 prompts, 8 samples" in text
    assert "| start model | 0.600 ± 0.000 | 0.190 ± 0.000 | 3.60 ± 0.00 | — | — | — |" in text
    h = summary["harder"]["arms"]
    # GRPO lost ~0.35 of pass@8 against its own start: the change is negative and starred (excludes 0)
    assert h["grpo"]["pass@8_change"]["mean"] == pytest.approx(-0.35, abs=0.03)
    assert "pass@8_gap" not in h["grpo"]  # no gap of the baseline to itself
    gap = h["clip_cov"]["pass@8_gap"]
    assert gap["mean"] == pytest.approx(0.30, abs=0.04) and abs(gap["mean"]) > gap["ci95"]
    assert h["clip_cov"]["mean@8_gap"]["mean"] == pytest.approx(0.19, abs=0.04)
    row = next(ln for ln in lines if ln.startswith("| clip_cov | ") and "±" in ln and ln.count("|") == 8)
    assert row.endswith(f"| {gap['mean']:.3f} ± {gap['ci95']:.3f} * | "
                        f"{h['clip_cov']['mean@8_gap']['mean']:.3f} ± {h['clip_cov']['mean@8_gap']['ci95']:.3f} * |")
    # a contrast is stated the same way, under its own key
    lines_c, summary_c = study_tables(numbers, 8, contrasts=[("clip_cov", "grpo")])
    vs = summary_c["harder"]["arms"]["clip_cov"]["pass@8_gap_vs_grpo"]
    assert vs == gap and f"- clip_cov − grpo: pass@8 {gap['mean']:.3f} ± {gap['ci95']:.3f} *, mean@8 " in "\n".join(lines_c)
    # one run without the evaluation: no section at all rather than a mean over some seeds
    numbers["grpo"][1] = dict(numbers["grpo"][1], harder=None)
    lines2, summary2 = study_tables(numbers, 8)
    assert "harder" not in summary2 and not any("one operation more" in ln for ln in lines2)


# ---------------------------------------------------------------- selection − random (configs/studies/selection.yaml)


def _sel_run(end, passk, seed, jaccard=None, harder_p8=0.3):
    run = dict(_run(0.4, end, passk, seed=seed), harder=_harder(0.6, harder_p8, 0.15, seed % 10))  # equal across arms
    run.update(selected_tokens=12.0 + seed % 2, selected_pos_adv_share=0.6, selected_prob=0.8, selected_pos=0.4,
               jaccard_vs_cov=jaccard)
    return run


def _pairs():
    return [{"arm": "kl_cov_0.1", "control": "kl_cov_random_0.1", "method": "kl_cov", "ratio": 0.1, "prompts": 16},
            {"arm": "clip_cov", "control": "clip_cov_random", "method": "clip_cov", "ratio": 0.02, "prompts": 16}]


def test_selection_section_states_which_contrasts_exclude_zero(tmp_path):
    from fastcov.trainer.experiments.study_report import plot_selection, selection_section

    numbers = {"kl_cov_0.1": [_sel_run(0.30, 0.9, s) for s in range(3)],  # +0.1 nats over its control
               "kl_cov_random_0.1": [_sel_run(0.20, 0.9, 10 + s, jaccard=0.05 + 0.01 * s) for s in range(3)],
               "clip_cov": [_sel_run(0.25, 0.9, 20 + s) for s in range(3)],  # as its control, within the noise
               "clip_cov_random": [_sel_run(0.25, 0.9, 30 + s, jaccard=0.01) for s in range(3)]}
    summary: dict = {}
    lines = selection_section(numbers, _pairs(), 8, summary)
    text = "\n".join(lines)
    kl, clip = summary["selection"]
    gap = kl["contrasts"]["entropy_end"]["diff"]
    ends = [[r["final_entropy"] for r in numbers[a]] for a in ("kl_cov_0.1", "kl_cov_random_0.1")]
    assert gap["mean"] == pytest.approx(sum(ends[0]) / 3 - sum(ends[1]) / 3) and gap["excludes_zero"]
    assert gap["ci95"] == pytest.approx(diff_ci(*ends)[1])  # Welch's interval, as everywhere in the report
    assert not clip["contrasts"]["entropy_end"]["diff"]["excludes_zero"]
    assert set(kl["contrasts"]) == {"entropy_end", "pass@8", "mean@8", "harder_pass@8", "harder_mean@8"}
    assert kl["jaccard"]["mean"] == pytest.approx(0.06) and kl["tokens"]["arm"]["mean"] == pytest.approx(37 / 3)
    assert "| kl_cov_0.1 | 0.1 | 16 | 12.3 ± " in text and "| 0.060 ± " in text and "| 0.053 |" in text  # chance
    assert f"| +{gap['mean']:.3f} ± {gap['ci95']:.3f} * |" in text
    paragraph = lines[-1]
    assert paragraph.startswith("Of the 10 selection − random contrasts, 1 excludes 0: KL-Cov 0.1, 16 prompts/step: "
                                f"entropy at the end (nats/token) +{gap['mean']:.3f} ± {gap['ci95']:.3f}.")
    assert "The others include 0." in paragraph and "Jaccard index of 0.06 (KL-Cov 0.1" in paragraph
    assert "| clip_cov_random | random | 0.60 | 0.800 | 0.40 |" in text  # what the tokens are
    assert plot_selection(summary["selection"], tmp_path / "sel.png", summary["selection_labels"]).is_file()
    # no contrast excludes 0 / one seed only: said so, not left out
    same = dict(numbers, **{"kl_cov_0.1": [_sel_run(0.20, 0.9, 10 + s) for s in range(3)]})  # the control's runs
    assert "none excludes 0" in selection_section(same, _pairs(), 8, {})[-1]
    one = {a: runs[:1] for a, runs in numbers.items()}
    assert "With one seed per arm there are no intervals" in selection_section(one, _pairs(), 8, {})[-1]


def test_target_holding_measures_error_share_and_first_arrival(tmp_path):
    from fastcov.trainer.experiments.study_report import plot_target, target_holding

    target = 0.25

    def run(ent, control=None):
        steps = list(range(1, len(ent) + 1))
        return {"steps": steps, "entropy": ent, "control_value": control or [None] * len(ent)}

    # held: falls from 0.4 to the target by step 5, then alternates 0.24 / 0.26 (|error| 0.01, inside 10%)
    held = [0.40, 0.36, 0.32, 0.29, 0.27] + [0.24, 0.26] * 5 + [0.25]
    # collapsing: passes through the band once (step 4: 0.26), then falls to 0.05
    falls = [0.40, 0.35, 0.30, 0.26, 0.20] + [0.05] * 11
    numbers = {"grpo": [run(falls), run([h + 0.002 for h in falls]), run([h - 0.002 for h in falls])],
               "ctl": [run(held, [0.001 * i for i in range(16)]), run(held[:1] + held[1:]), run(held)]}
    lines, summary = target_holding(numbers, target)
    ctl, grpo = summary["arms"]["ctl"], summary["arms"]["grpo"]
    second = held[8:]
    assert ctl["abs_error"]["mean"] == pytest.approx(sum(abs(h - target) for h in second) / len(second))
    assert ctl["share_within_10pct"]["mean"] == pytest.approx(1.0)
    assert ctl["first_step_within_10pct"] == [5, 5, 5]
    assert grpo["first_step_within_10pct"] == [4, 4, 4]
    assert grpo["abs_error"]["mean"] == pytest.approx(0.20, abs=0.003) and grpo["share_within_10pct"]["mean"] == 0
    assert ctl["abs_error_gap"]["mean"] == pytest.approx(ctl["abs_error"]["mean"] - grpo["abs_error"]["mean"])
    assert ctl["abs_error_gap"]["excludes_zero"]
    text = "\n".join(lines)
    assert "| ctl |" in text and "5, 5, 5" in text and "ctl − grpo, mean abs(H − target)" in text
    # an arm that never comes within 10% says so
    _, summary = target_holding({"grpo": [run([0.4] * 6)] * 2}, target)
    assert summary["arms"]["grpo"]["first_step_within_10pct"] == [None, None]
    png = plot_target(numbers, target, tmp_path / "t.png")
    assert png is None or (png.is_file() and png.stat().st_size > 1000)


def test_study_target_must_be_a_positive_number(tmp_path):
    from fastcov.errors import UserError
    from fastcov.trainer.experiments.study import load_study

    for bad in ("0", "-0.1", "true", "high"):
        p = tmp_path / "s.yaml"
        p.write_text(f"arms: {{a: [algo.mode=vanilla]}}\ntarget: {bad}\n")
        with pytest.raises(UserError, match="target must be a positive number"):
            load_study(p)
    p.write_text("arms: {a: [algo.mode=vanilla]}\ntarget: 0.25\n")
    assert load_study(p)["target"] == 0.25
