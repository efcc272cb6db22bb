"""The one-line error contract end to end, in a real process: `python -m fastcov.cli` (how the deepspeed
and torchrun launchers start it) prints one stderr line and exits 2; --debug shows the traceback."""

import subprocess
import sys
from pathlib import Path

from _dist import without_rank_environment

ROOT = Path(__file__).resolve().parents[3]


def _run(*args):
    env = without_rank_environment("FASTCOV_DEBUG")
    return subprocess.run([sys.executable, "-m", "fastcov.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


def test_module_entry_point_prints_one_line():
    res = _run("train", "configs/tiny.yaml", "optim.lr=.inf")
    assert res.returncode == 2
    assert res.stderr.strip() == "fastcov train: optim.lr: must be a finite number, got inf"


def test_debug_flag_shows_the_traceback():
    res = _run("train", "configs/tiny.yaml", "optim.lr=.inf", "--debug")
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "ConfigError: optim.lr: must be a finite number" in res.stderr
