"""The shipped configs are found the same way from a checkout and from an installed wheel: the demo and studies
resolve ``configs/...`` from any working directory, the user's own file first. The wheel's half (built, installed,
probed): tests/project/e2e/test_wheel_configs_e2e.py; kernels/ as ``fastcov.kernels``: test_kernels_name.py."""

from __future__ import annotations

from pathlib import Path

from fastcov.trainer.experiments.configs import resolve_config, shipped_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_checkout_resolves_shipped_configs_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped_config("demo.yaml") == ROOT / "configs" / "demo.yaml"
    assert resolve_config("configs/studies/hard-task.yaml") == ROOT / "configs" / "studies" / "hard-task.yaml"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text("mine: 1\n")
    assert resolve_config("configs/demo.yaml") == Path("configs/demo.yaml")  # the user's own file wins
    assert resolve_config("configs/nope.yaml") == Path("configs/nope.yaml")  # left for the loader to name
