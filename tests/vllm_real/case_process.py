"""A vLLM case in a process of its own (one vLLM engine per process): the test side starts
``python CASE_FILE SPEC_JSON OUT_JSON`` and reads OUT_JSON back; the case file's ``__main__`` is ``main(run)``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def run_case_process(case_file: Path, spec: dict, tmp_path: Path) -> tuple[dict, str]:
    """(the case's result, its stderr); fails the test with the stderr's tail when the process fails."""
    out = tmp_path / "out.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(case_file), json.dumps(spec), str(out)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"case {spec} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stderr


def main(run: Callable[[dict, str], dict]) -> None:
    """A case file's entry point: ``run(spec, run_dir)`` with the spec from argv, its result to OUT_JSON."""
    spec, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out.write_text(json.dumps(run(spec, str(out.parent / "run")), indent=1))
