"""Every shipped config (configs/*.yaml, and every arm of configs/studies/) resolves to the settings it had before
the config became a package with ``algo.loss`` nested (issue 56): shipped_settings.json holds them, computed by the
config reader of main at 22caf1f as flat dotted keys (the non-default ones per config, and the defaults once)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from fastcov.trainer.config import MOVED_KEYS, Config, load_config

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = json.loads((Path(__file__).with_name("shipped_settings.json")).read_text())


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def before(name: str) -> dict:
    """The settings main gave ``name``, under today's keys (each moved key under its new name)."""
    entry = FIXTURE["configs"][name]
    absent = set(entry.get("absent", ()))
    settings = {**{k: v for k, v in FIXTURE["defaults"].items() if k not in absent}, **entry["settings"]}
    return {MOVED_KEYS.get(k, k): v for k, v in settings.items()}


# what main's config did not have: LossConfig's fields the trainer set itself (check_finite off, no scale factor)
# (a field added to a section later is checked to hold its default: assert_same)
ADDED = {"algo.loss.loss_scale_factor": None, "algo.loss.check_finite": False}


def test_the_fixture_covers_every_shipped_config():
    runs = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    arms = {f"studies/{p.name}:{arm}" for p in (ROOT / "configs" / "studies").glob("*.yaml")
            for arm in yaml.safe_load(p.read_text())["arms"]}
    assert set(FIXTURE["configs"]) == runs | arms


@pytest.mark.parametrize("name", sorted(FIXTURE["configs"]))
def test_a_shipped_config_resolves_to_the_settings_it_had(name):
    entry = FIXTURE["configs"][name]
    path, overrides = ROOT / "configs" / name, entry["overrides"]
    if ":" in name:  # a study's arm: its base with today's overrides (the study file's keys moved too)
        study_file, arm = name.split(":")
        study = yaml.safe_load((ROOT / "configs" / study_file).read_text())
        path, overrides = ROOT / study.get("base", "configs/demo.yaml"), [*(study.get("common") or []),
                                                                          *study["arms"][arm]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the shipped files and studies use no moved key
        cfg = load_config(path, overrides)
    assert_same(flat(cfg.to_dict()), {**before(name), **ADDED})


def test_the_defaults_are_the_ones_main_had():
    assert_same(flat(Config().to_dict()), {**{MOVED_KEYS.get(k, k): v for k, v in FIXTURE["defaults"].items()}, **ADDED})


def assert_same(now: dict, then: dict) -> None:
    """Every setting main had is the same now; a key main did not have (a field added since) holds its default."""
    assert {k: now.get(k, "<missing>") for k in then} == then
    defaults = flat(Config().to_dict())
    assert {k: v for k, v in now.items() if k not in then} == {k: defaults[k] for k in now if k not in then}
