"""The run directory: what lives in it, who may write it, and the one reader of its metrics.

    <run>/config.yaml      the resolved config          <run>/metrics.jsonl   one JSON row per step
    <run>/checkpoints/     step_NNNNNN/ (atomic)        <run>/final/          the exported HF model
    <run>/data/            the synthetic task, regenerated identically when missing

Every reader of metrics.jsonl goes through ``parse_metrics`` and so shares one policy for damage: a
torn last line (the process died mid-write) is dropped; any other bad line is the user's to fix and
raises a ``UserError`` naming the file and line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastcov.errors import ConfigError, UserError
from fastcov.trainer.runtime.checkpoint import (
    CheckpointError,
    check_checkpoint,
    fsync_path,
    latest_checkpoint,
    write_atomic,
)

METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"
FINAL = "final"
DATA = "data"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def final_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / FINAL


def data_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / DATA


# A run directory holding nothing but these can be trained into afresh (data/: the synthetic task,
# which a run only writes when missing and regenerates identically).
REGENERABLE = {"data"}


def check_run_dir(run_dir: Path, resume, overwrite: bool, rank: int) -> Path | None:
    """What a run may do with ``run_dir``, decided before anything is written (every rank calls it).

    Fresh run: the directory must be absent or hold no earlier run, unless ``overwrite`` (the old one
    is then moved aside, never deleted: ``prepare_run_dir``). ``resume``: True for the newest checkpoint,
    or a checkpoint directory; it must exist and read back. Returns the checkpoint to resume from.
    Raises CheckpointError / ConfigError (user errors, one line each).
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: resume continues the run in "
                          "trainer.run_dir, overwrite moves it aside and starts afresh")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"trainer.run_dir: {str(run_dir)!r} is a file; choose a directory")
    if resume:
        ckpt_root = checkpoints_dir(run_dir)
        path = latest_checkpoint(ckpt_root) if resume is True else Path(resume)
        if path is None:
            raise CheckpointError(f"--resume: no checkpoint under {str(ckpt_root)!r}; start the run without "
                                  "--resume (add --overwrite if the directory is not empty)")
        check_checkpoint(path, rank)
        return path
    if run_dir.is_dir() and not overwrite:
        held = sorted(p.name for p in run_dir.iterdir() if p.name not in REGENERABLE)
        if held:
            raise CheckpointError(f"trainer.run_dir: {str(run_dir)!r} already holds a run ({', '.join(held[:3])}"
                                  f"{', ...' if len(held) > 3 else ''}); continue it with --resume, move it "
                                  "aside with --overwrite, or choose another trainer.run_dir")
    return None


def prepare_run_dir(run_dir: Path, overwrite: bool) -> Path | None:
    """Rank 0: move an existing run aside (``--overwrite``), create the directory. Returns where the
    old run went, if anywhere."""
    moved = None
    if overwrite and run_dir.is_dir() and any(p.name not in REGENERABLE for p in run_dir.iterdir()):
        moved = move_aside(run_dir)
        print(f"[fastcov] --overwrite: the previous run in {run_dir} was moved to {moved}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    return moved


def _metrics_row(line: bytes) -> dict[str, Any] | None:
    """The row a line holds, or None when it is not a metrics row (not JSON, not an object, no int step)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    return row


def parse_metrics(raw: bytes, path: str | Path) -> tuple[list[tuple[int, bytes, dict[str, Any]]], int]:
    """(line number, line, row) triples of a metrics.jsonl's bytes, and how many torn lines were dropped.

    The last line is torn when no newline ends it, or when it is not a metrics row: a process killed
    mid-write leaves either. A bad line anywhere else raises ``UserError`` naming ``path`` and the line.
    """
    lines = raw.split(b"\n")
    ended = bool(lines) and lines[-1] == b""
    if ended:
        lines.pop()
    torn = 0
    if lines and not ended:
        lines.pop()
        torn = 1
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = _metrics_row(line)
        if row is None:
            if i == len(lines):  # the last line, newline included but bytes lost: torn too
                torn += 1
                continue
            raise UserError(f"{path}:{i}: not a metrics row (a JSON object with an integer 'step'); "
                            "fix or remove the line")
        out.append((i, line, row))
    return out, torn


def read_numbered_metrics(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs of a metrics.jsonl (or of ``<run>/metrics.jsonl`` given the run directory)."""
    path = Path(path)
    if path.is_dir():
        path = metrics_path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{str(path)!r} does not exist (is this a run directory?)") from None
    except OSError as exc:
        raise UserError(f"cannot read {str(path)!r} ({exc.strerror or exc})") from None
    return [(i, row) for i, _, row in parse_metrics(raw, path)[0]]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (or of ``<run>/metrics.jsonl`` when given the run directory)."""
    return [row for _, row in read_numbered_metrics(path)]


def last_step(path: str | Path) -> int:
    """The step of the last complete row of a metrics.jsonl (0 when there is none or no file)."""
    try:
        rows = read_metrics(path)
    except UserError:
        return 0
    return int(rows[-1]["step"]) if rows else 0


def trim_metrics(path: Path, last_step: int) -> dict[str, int]:
    """Make ``metrics.jsonl`` end at ``last_step`` for a resume, whatever a crash left in it.

    Drops a torn last line (``parse_metrics``) and every row after ``last_step``; a row for a step
    already seen is dropped too, so each step has exactly one row. A damaged line that is not the last
    one is not a crash's doing: ``CheckpointError`` names its line. The file is replaced atomically.
    Returns counts {"kept", "dropped", "torn"}.
    """
    path = Path(path)
    if not path.exists():
        return {"kept": 0, "dropped": 0, "torn": 0}
    raw = path.read_bytes()
    try:
        rows, torn = parse_metrics(raw, path)
    except UserError as exc:
        raise CheckpointError(f"{exc} (damaged file), then resume") from None
    keep: list[bytes] = []
    seen: set[int] = set()
    for _, line, row in rows:
        if row["step"] <= last_step and row["step"] not in seen:
            seen.add(row["step"])
            keep.append(line)
    new = b"".join(ln + b"\n" for ln in keep)
    if new != raw:
        write_atomic(path, new)
    return {"kept": len(keep), "dropped": len(rows) - len(keep), "torn": torn}


def move_aside(run_dir: Path) -> Path:
    """Rename a run directory to ``<name>.old-YYYYmmdd-HHMMSS[-N]`` next to it; returns the new path."""
    run_dir = Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    run_dir.rename(target)
    fsync_path(run_dir.parent)
    return target

