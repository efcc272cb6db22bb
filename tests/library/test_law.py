"""fit_entropy_law and `fastcov fit-law`: recovery of known coefficients, hold-out error, validation, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fastcov.cli import main as cli_main
from fastcov.law import EntropyLaw, fit_entropy_law


def _synthetic_run(rng, n=120, a=0.35, b=0.9, noise=0.0):
    """Entropy decaying over a run, reward on the law, optional Gaussian noise (float64)."""
    steps = np.arange(n, dtype=np.float64)
    h = 1.2 * np.exp(-steps / (0.3 * n)) + 0.05 + 0.02 * rng.random(n)
    r = b - a * np.exp(h) + noise * rng.standard_normal(n)
    return h, r


def _reference_lstsq(h, r):
    """float64 reference via numpy.linalg.lstsq on [1, -exp(H)]: returns (a, b)."""
    design = np.stack([np.ones_like(h), -np.exp(h)], axis=1)
    (b, a), *_ = np.linalg.lstsq(design, r, rcond=None)
    return float(a), float(b)


def test_exact_law_recovered():
    rng = np.random.default_rng(20250522)
    a, b = rng.uniform(0.1, 1.0), rng.uniform(0.5, 2.0)
    h, r = _synthetic_run(rng, a=a, b=b)
    law = fit_entropy_law(h, r)
    assert isinstance(law, EntropyLaw)
    assert law.a == pytest.approx(a, rel=1e-10)
    assert law.b == pytest.approx(b, rel=1e-10)
    assert law.r2 == pytest.approx(1.0, abs=1e-12)
    assert law.ceiling == pytest.approx(b - a, rel=1e-10)
    assert (law.n_fit, law.n_total, law.holdout_rmse) == (h.size, h.size, None)
    assert law.predict(0.0) == pytest.approx(b - a)
    grid = np.array([[0.1, 0.5], [1.0, 2.0]])
    np.testing.assert_allclose(law.predict(grid), b - a * np.exp(grid), rtol=1e-10)
    assert isinstance(law.predict(0.3), float) and law.predict(grid).shape == (2, 2)


def test_noisy_fit_matches_lstsq_reference_and_r2():
    rng = np.random.default_rng(7)
    h, r = _synthetic_run(rng, n=80, noise=0.02)
    law = fit_entropy_law(list(h), list(r))
    a_ref, b_ref = _reference_lstsq(h, r)
    assert law.a == pytest.approx(a_ref, rel=1e-9)
    assert law.b == pytest.approx(b_ref, rel=1e-9)
    pred = b_ref - a_ref * np.exp(h)
    r2_ref = 1 - np.sum((r - pred) ** 2) / np.sum((r - r.mean()) ** 2)
    assert law.r2 == pytest.approx(r2_ref, rel=1e-9)
    assert 0.5 < law.r2 < 1.0


def test_torch_input_accepted():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    h, r = _synthetic_run(rng, n=30, noise=0.01)
    law_t = fit_entropy_law(torch.tensor(h, dtype=torch.float64), torch.tensor(r, dtype=torch.float64))
    law_n = fit_entropy_law(h, r)
    assert law_t.a == pytest.approx(law_n.a, rel=1e-12) and law_t.b == pytest.approx(law_n.b, rel=1e-12)


def test_holdout_uses_prefix_in_step_order():
    rng = np.random.default_rng(11)
    h, r = _synthetic_run(rng, n=100, noise=0.01)
    law = fit_entropy_law(h, r, fit_fraction=0.25)
    assert law.n_fit == 25 and law.n_total == 100
    a_ref, b_ref = _reference_lstsq(h[:25], r[:25])
    assert law.a == pytest.approx(a_ref, rel=1e-9) and law.b == pytest.approx(b_ref, rel=1e-9)
    rmse_ref = math.sqrt(np.mean((r[25:] - (b_ref - a_ref * np.exp(h[25:]))) ** 2))
    assert law.holdout_rmse == pytest.approx(rmse_ref, rel=1e-9)
    # the hold-out must see the tail: corrupt it and the RMSE (only) changes
    r_bad = r.copy()
    r_bad[25:] += 0.5
    bad = fit_entropy_law(h, r_bad, fit_fraction=0.25)
    assert bad.a == pytest.approx(law.a) and bad.holdout_rmse > law.holdout_rmse + 0.3


def test_fraction_just_below_one_holds_out_one_point():
    h, r = [0.1, 0.2, 0.3, 0.4], [0.5, 0.45, 0.38, 0.1]
    law = fit_entropy_law(h, r, fit_fraction=0.99)
    a_ref, b_ref = _reference_lstsq(np.array(h[:3]), np.array(r[:3]))
    assert law.n_fit == 3 and law.holdout_rmse == pytest.approx(abs(r[3] - (b_ref - a_ref * math.exp(h[3]))))


def test_constant_reward_gives_r2_one_and_zero_slope():
    h = np.linspace(0.1, 1.0, 10)
    law = fit_entropy_law(h, np.full(10, 0.7))
    assert law.a == pytest.approx(0.0, abs=1e-12) and law.b == pytest.approx(0.7) and law.r2 == 1.0


@pytest.mark.parametrize("entropy, reward, kwargs, match", [
    ([0.1, 0.2, 0.3], [0.5, 0.6], {}, "entropy and reward must have the same length"),
    ([0.1, 0.2], [0.5, 0.6], {}, "need at least 3 points"),
    ([0.1, float("nan"), 0.3], [0.5, 0.6, 0.7], {}, "entropy has a non-finite value at index 1"),
    ([0.1, 0.2, 0.3], [0.5, 0.6, float("inf")], {}, "reward has a non-finite value at index 2"),
    ([[0.1, 0.2, 0.3]], [[0.5, 0.6, 0.7]], {}, "entropy must be 1-D"),
    ([0.1, 0.2, 0.3], ["a", "b", "c"], {}, "reward must be a 1-D sequence of numbers"),
    ([0.1, 0.2, 0.3], [0.5, 0.6, 0.7], {"fit_fraction": 0.0}, r"fit_fraction must be in \(0, 1\]"),
    ([0.1, 0.2, 0.3], [0.5, 0.6, 0.7], {"fit_fraction": 1.5}, r"fit_fraction must be in \(0, 1\]"),
    ([0.1, 0.2, 0.3], [0.5, 0.6, 0.7], {"fit_fraction": float("nan")}, r"fit_fraction must be in \(0, 1\]"),
    (list(np.linspace(0, 1, 10)), [0.5] * 10, {"fit_fraction": 0.2}, "fit_fraction=0.2 of 10 points leaves 2 in the fit"),
    ([0.4, 0.4, 0.4, 0.4], [0.5, 0.6, 0.7, 0.8], {}, "entropy is constant"),
])
def test_validation_names_the_argument(entropy, reward, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_entropy_law(entropy, reward, **kwargs)


def test_plot_and_to_dict(tmp_path):
    rng = np.random.default_rng(5)
    h, r = _synthetic_run(rng, n=40, noise=0.01)
    law = fit_entropy_law(h, r, fit_fraction=0.5)
    out = law.plot(tmp_path / "law.png")
    png = (tmp_path / "law.png").read_bytes()
    assert out.endswith("law.png") and png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    d = json.loads(json.dumps(law.to_dict()))
    assert set(d) == {"a", "b", "r2", "ceiling", "n_fit", "n_total", "fit_fraction", "holdout_rmse"}
    assert d["ceiling"] == pytest.approx(law.b - law.a) and d["n_fit"] == 20


def _write_metrics(path, h, r, eval_every=3):
    """One row per step; val_acc only on eval steps (the rows the CLI must skip lack it)."""
    with open(path, "w", encoding="utf-8") as fh:
        for step, (hi, ri) in enumerate(zip(h, r, strict=True)):
            row = {"step": step, "entropy": float(hi), "reward": float(ri) + 0.1}
            if step % eval_every == 0:
                row["val_acc"] = float(ri)
            fh.write(json.dumps(row) + "\n")
            if step == 4:
                fh.write("\n")  # blank lines are ignored


def test_cli_fit_law(tmp_path, capsys):
    rng = np.random.default_rng(99)
    h, r = _synthetic_run(rng, n=90, noise=0.01)
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics, h, r)
    png, js = tmp_path / "law.png", tmp_path / "law.json"
    rc = cli_main(["fit-law", str(metrics), "--x", "entropy", "--y", "val_acc", "--fit-fraction", "0.25",
                   "--plot", str(png), "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    ref = fit_entropy_law(h[::3], r[::3], fit_fraction=0.25)  # 30 eval rows, 60 skipped
    assert "30 points" in out and "60 rows skipped" in out
    assert f"{ref.a:.6g}" in out and f"{ref.b:.6g}" in out and f"{ref.ceiling:.6g}" in out
    assert "R^2" in out and f"{ref.holdout_rmse:.6g}" in out
    got = json.loads(js.read_text())
    assert got["a"] == pytest.approx(ref.a, rel=1e-12) and got["holdout_rmse"] == pytest.approx(ref.holdout_rmse)
    assert got["n_fit"] == 7 and got["skipped_rows"] == 60 and got["y"] == "val_acc"
    assert png.read_bytes()[:4] == b"\x89PNG"

    # another column, every row has it
    assert cli_main(["fit-law", str(metrics), "--y", "reward"]) == 0
    out = capsys.readouterr().out
    assert "90 points" in out and "hold-out  = none" in out


def test_cli_errors(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"entropy": 0.5, "val_acc": 0.4}\n{"entropy": 0.4, "val_acc": "high"}\n')
    assert cli_main(["fit-law", str(metrics)]) == 2
    assert "m.jsonl:2: 'val_acc' must be a number" in capsys.readouterr().err
    metrics.write_text('{"entropy": 0.5, "val_acc": 0.4}\n[1, 2]\n')
    assert cli_main(["fit-law", str(metrics)]) == 2
    assert "m.jsonl:2: expected a JSON object" in capsys.readouterr().err
    metrics.write_text('{"entropy": 0.5, "val_acc": 0.4}\n{oops\n')
    assert cli_main(["fit-law", str(metrics)]) == 2
    assert "m.jsonl:2: not valid JSON" in capsys.readouterr().err
    metrics.write_text('{"entropy": 0.5}\n{"entropy": 0.4}\n')
    assert cli_main(["fit-law", str(metrics)]) == 2
    assert "no row of" in capsys.readouterr().err
    metrics.write_text("".join(json.dumps({"entropy": 0.1 * i, "val_acc": 0.1 * i}) + "\n" for i in range(1, 9)))
    assert cli_main(["fit-law", str(metrics), "--fit-fraction", "0.2"]) == 2
    assert "fit_fraction=0.2 of 8 points leaves 1 in the fit" in capsys.readouterr().err
    assert cli_main(["fit-law", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
