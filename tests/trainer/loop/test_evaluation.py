"""The trainer's evaluation: pass@k, mean@k, diversity and calibration from the same samples, equal to
fastcov.metrics applied to those samples; `fastcov eval` and the report show them."""

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from fastcov.metrics import (
    brier_score,
    distinct_answers,
    distinct_n,
    expected_calibration_error,
    pass_at_k_table,
    sequence_confidence,
)
from fastcov.trainer import evaluation
from fastcov.trainer import train as train_mod
from fastcov.trainer.config import Config
from fastcov.trainer.rewards import extract_boxed
from fastcov.trainer.rollout import RolloutBatch


class FakeRollout:
    """Sample j of prompt p answers str((p * j) % 3) with token ids [p, j % 2, 7] and log-prob -(p+j)/10."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, generator=None):
        self.calls.append(sampling)
        ids, lps, seen = [], [], {}
        for p in prompts:
            key = p[0]
            j = seen.get(key, 0)
            seen[key] = j + 1
            ids.append([key, j % 2, 7])
            lps.append([-(key + j) / 10.0] * 3)
        return RolloutBatch(ids, lps)


class FakeTok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [f"\\boxed{{{(t[0] * (t[1] + 1)) % 3}}}" for t in ids]


class FakeReward:
    def final_answer(self, text):
        return extract_boxed(text)

    def check_batch(self, texts, truths):
        return [t == f"\\boxed{{{g}}}" for t, g in zip(texts, truths, strict=True)]


def test_evaluate_matches_the_metric_functions():
    cfg = Config()
    cfg.trainer.eval_k = 4
    cfg.trainer.eval_sample_all = True
    truth = {p: str(p % 3) if p < 6 else "2" for p in range(1, 7)}  # prompt 6 is never answered right
    val = [SimpleNamespace(prompt_ids=[p], ground_truth=truth[p], data_source="synthetic") for p in range(1, 7)]
    rollout = FakeRollout()
    res = evaluation.evaluate(rollout, val, FakeReward(), FakeTok(), cfg, 0, 1, torch.device("cpu"), 0)
    assert rollout.calls[0].temperature == cfg.trainer.eval_temperature  # sampled, not greedy
    # the same samples, scored by hand
    oks, confs, flat_ok, ids_by_p, answers_by_p = [], [], [], [], []
    tok, rew = FakeTok(), FakeReward()
    for p in range(1, 7):
        ids = [[p, j % 2, 7] for j in range(4)]
        texts = tok.batch_decode(ids)
        ok = rew.check_batch(texts, [truth[p]] * 4)
        oks.append(ok)
        flat_ok += ok
        confs += [sequence_confidence([-(p + j) / 10.0] * 3) for j in range(4)]
        ids_by_p.append(ids)
        answers_by_p.append([t[len("\\boxed{"):-1] for t in texts])
    table = pass_at_k_table(oks)
    for k in (1, 2, 4):
        assert res[f"val_pass@{k}"] == pytest.approx(table[f"pass@{k}"])
        assert res[f"val_mean@{k}"] == pytest.approx(table[f"mean@{k}"])
    assert res["val_acc"] == pytest.approx(table["mean@4"])
    assert 0 < res["val_pass@1"] < res["val_pass@4"] < 1  # the test data is not degenerate
    assert res["val_distinct_2"] == pytest.approx(sum(distinct_n(i, 2) for i in ids_by_p) / 6)
    assert res["val_distinct_answers"] == pytest.approx(sum(distinct_answers(a) for a in answers_by_p) / 6)
    assert res["val_ece"] == pytest.approx(expected_calibration_error(confs, flat_ok))
    assert res["val_brier"] == pytest.approx(brier_score(confs, flat_ok))
    assert sum(b[0] for b in res["val_calibration_bins"]) == 24


def test_report_shows_eval_metrics_and_reliability_plot(tmp_path):
    import json

    from fastcov.trainer.experiments.report import write_report

    for name, acc in (("a", 0.3), ("b", 0.6)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": 0, "val_acc": acc}]
        for s in range(1, 5):
            rows.append({"step": s, "entropy": 1.0 / s, "reward_mean": acc, "val_acc": acc + s / 100,
                         "val_pass@1": acc, "val_pass@4": acc + 0.2, "val_mean@4": acc, "val_distinct_2": 0.5,
                         "val_distinct_answers": 2.0, "val_ece": 0.1, "val_brier": 0.2, "val_confidence": 0.4,
                         "val_calibration_bins": [[1, 0.05, 0.0]] + [[0, None, None]] * 8 + [[3, 0.95, 1.0]]})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path, _ = write_report([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    text = path.read_text()
    assert "pass@4" in text and "ECE" in text and "reliability.png" in text
    assert (tmp_path / "out" / "reliability.png").stat().st_size > 1000
    assert math.isclose(float(text.split("| a |")[-1].split("|")[2]), 0.5, abs_tol=1e-3)  # pass@4 of run a


def test_fastcov_eval_cli_reports_pass_at_k(tmp_path, capsys):
    import json

    from fastcov.cli import main
    from fastcov.trainer.config import load_config

    run = train_mod.train(load_config("configs/tiny.yaml", [
        f"trainer.run_dir={tmp_path / 'run'}", "reward.sandbox=inline", "trainer.max_steps=1",
        "trainer.eval_every=0", "algo.mode=vanilla"]))
    capsys.readouterr()
    plot = tmp_path / "rel.png"
    # --k 4 alone samples every prompt 4 times (the synthetic task's source is greedy under --greedy-sources)
    assert main(["eval", "--model", str(run / "final"), "--data", str(run / "data" / "val.parquet"), "--k", "4",
                 "--temperature", "1.0", "--max-new-tokens", "6", "--json",
                 "--reliability-plot", str(plot)]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("val_pass@1", "val_pass@2", "val_pass@4", "val_mean@4", "val_distinct_2", "val_ece", "val_brier"):
        assert key in res, key
    assert res["val_pass@1"] <= res["val_pass@2"] <= res["val_pass@4"]
    assert plot.stat().st_size > 1000
    # code tasks: the same metrics, answers run against the rows' tests (this untrained model writes no code)
    from fastcov.trainer.rewards.code_task import write_code_task

    write_code_task(str(tmp_path / "code.jsonl"), None, n_train=3)
    assert main(["eval", "--model", str(run / "final"), "--data", str(tmp_path / "code.jsonl"), "--k", "2",
                 "--sample-all", "--task", "code", "--max-new-tokens", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["prompts"] == 3 and res["val_pass@2"] == 0.0 and "val_distinct_answers" in res


class SeededRollout(FakeRollout):
    """Answers drawn from the call's generator, or from each sample's own seed (``sampling.seeds``)."""

    def generate(self, prompts, sampling, generator=None):
        self.calls.append(sampling)
        ids, lps = [], []
        for n, p in enumerate(prompts):
            g = generator if sampling.seeds is None else torch.Generator().manual_seed(sampling.seeds[n])
            j = int(torch.randint(0, 1000, (1,), generator=g))
            ids.append([p[0], j % 2, 7])
            lps.append([-(j % 13) / 10.0] * 3)
        return RolloutBatch(ids, lps)


@pytest.mark.parametrize("seeding", ["batch", "per_sample"])
def test_sampled_evaluation_under_per_sample_seeding_does_not_depend_on_the_ranks(seeding):
    """rollout.seeding per_sample: every sample of the evaluation has its own seed, so two ranks that each
    evaluate half of the prompts draw the samples one rank draws for all (batch seeding does not)."""
    cfg = Config()
    cfg.trainer.eval_k = 4
    cfg.trainer.eval_sample_all = True
    cfg.rollout.seeding = seeding
    val = [SimpleNamespace(prompt_ids=[p], ground_truth=str(p % 3), data_source="synthetic") for p in range(1, 10)]

    def run(rank, world):
        rollout = SeededRollout()
        res = evaluation.evaluate(rollout, val, FakeReward(), FakeTok(), cfg, rank, world, torch.device("cpu"), 20)
        return res, len(val[rank::world])

    (whole, n), halves = run(0, 1), [run(r, 2) for r in (0, 1)]
    joined = sum(res["val_acc"] * m for res, m in halves) / n  # all_sum is local without a process group
    brier = sum(res["val_brier"] * m for res, m in halves) / n
    same = joined == pytest.approx(whole["val_acc"], abs=1e-12) and brier == pytest.approx(whole["val_brier"],
                                                                                          abs=1e-12)
    assert same == (seeding == "per_sample")
