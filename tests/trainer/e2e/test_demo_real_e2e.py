"""`make demo-real` (trainer/experiments/demo_real.py) end to end on a tiny GGUF model instead of SmolLM2's 98 MB:
the conversion, the level scan and its cache, three runs, the before/after evaluation, the report and its JSON
(the level pick and the preset's install hint: tests/trainer/experiments/test_demo_real.py)."""

import json

import pytest

pytest.importorskip("gguf")

from fastcov.trainer.experiments import demo_real


@pytest.mark.slow
def test_demo_real_on_a_tiny_gguf_model(tmp_path):
    from _gguf import tiny_hf_model, write_gguf

    write_gguf(tiny_hf_model("llama", tied=True), tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    args = ["--model", str(tmp_path / "tiny.gguf"), "--out", str(out), "--levels", "d1o1,d2o1", "--level", "d1o1",
            "--scan-prompts", "2", "--n-train", "16", "--n-val", "3", "trainer.max_steps=3", "rollout.n=2",
            "trainer.prompts_per_step=2", "rollout.max_new_tokens=5", "trainer.progress=false"]
    assert demo_real.main(args) == 0
    facts = json.loads((out / "demo_real.json").read_text())
    assert facts["level"] == "d1o1" and facts["level_given"] and set(facts["scan"]) == {"d1o1", "d2o1"}
    assert set(facts["end"]) == set(facts["runs"]) == {"grpo", "clip_cov", "kl_cov"}
    for name, run in facts["runs"].items():
        assert len(run["entropy"]) == 3 and run["eval_steps"] == [0, 1, 2, 3], name
        assert run["law"] is not None or "no law fit" in "".join(facts["verdict"])
        end = json.loads((out / name / "task_eval.json").read_text())
        assert end["start"] == facts["start"] and end["end"]["prompts"] == 3
    assert (out / "model" / "gguf-source.json").is_file()
    report = (out / "report.md").read_text()
    for text in ("| d1o1 (trained) |", "named with --level", "pass@8", "GRPO's entropy went", "law.png"):
        assert text in report, text
    for png in ("entropy.png", "val_acc.png", "law.png"):
        assert (out / png).stat().st_size > 1000
    # a second run keeps the conversion and the scan (cached for the same model, prompts and length)
    stamp = (out / "levels.json").stat().st_mtime_ns
    assert demo_real.main(args + ["--algos", "grpo"]) == 0
    assert (out / "levels.json").stat().st_mtime_ns == stamp
