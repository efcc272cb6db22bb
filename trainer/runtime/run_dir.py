"""The run directory: what lives in it, who may write it, and the one reader of its metrics.

    <run>/config.yaml      the resolved config          <run>/metrics.jsonl   one JSON row per step
    <run>/checkpoints/     step_NNNNNN/ (atomic)        <run>/final/          the exported HF model
    <run>/data/            the synthetic task, regenerated identically when missing
    <run>/gguf-model/      a GGUF model.path converted to a Hugging Face directory (runtime/gguf.py)

Every reader of metrics.jsonl goes through ``parse_metrics`` and so shares one policy for damage: a
torn last line (the process died mid-write) is dropped; any other bad line is the user's to fix and
raises a ``UserError`` naming the file and line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from fastcov.errors import ConfigError, UserError
from fastcov.trainer.data.loading import staging_dir
from fastcov.trainer.runtime.checkpoint import (
    CheckpointError,
    check_checkpoint,
    fsync_path,
    latest_checkpoint,
    write_atomic,
)
from fastcov.trainer.runtime.distributed import all_max, broadcast_text

logger = logging.getLogger(__name__)

LOCK = ".lock"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"
FINAL = "final"
DATA = "data"
GGUF_MODEL = "gguf-model"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def data_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / DATA


# A run directory holding nothing but these can be trained into afresh (data/: the synthetic task,
# which a run only writes when missing and regenerates identically, and its temporary folder; gguf-model/: a
# GGUF model converted, the same again from the same file; .lock: who holds the directory).
REGENERABLE = {DATA, staging_dir(Path(DATA)).name, GGUF_MODEL, f".{GGUF_MODEL}.tmp", LOCK}


class RunDirBusy(UserError):
    """Another live process holds the run directory."""


def io_error(path: str | Path, exc: OSError, what: str = "trainer.run_dir") -> UserError:
    """An OSError on a run file as the user's one line: the path, the system's reason, what to do."""
    reason = exc.strerror or str(exc)
    hint = {errno.EROFS: f"choose a writable {what}", errno.EACCES: f"fix its permissions or choose another {what}",
            errno.EPERM: f"fix its permissions or choose another {what}",
            errno.ENOSPC: "free space on that disk, then --resume", errno.EDQUOT: "free space (quota), then --resume"}
    return UserError(f"{what}: cannot write {str(path)!r} ({reason}); "
                     f"{hint.get(exc.errno or 0, 'check the path and the disk')}")


class RunDirLock:
    """One run per directory: an advisory lock (``fcntl.flock``) on ``<run>/.lock``, held by rank 0 from
    before the run writes anything until it ends. The file names the holder (pid, host, start); the kernel
    drops the lock when the holder dies, so a lock left by a killed run is taken over, and said so once."""

    def __init__(self, run_dir: Path, fd: int, created: tuple[bool, bool], previous: bytes = b"",
                 made_data: bool = True):
        self.run_dir, self.fd, self.created = Path(run_dir), fd, created  # (the directory, the lock file)
        self.previous = previous  # what the lock file said before this run took it (a dead holder's details)
        self.made_data = made_data  # data/ was not there: whatever is there after a failed start-up is this run's
        self.started = False  # set once the run's start-up is done: a failure after it keeps what the run made

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunDirLock:
        run_dir = Path(run_dir)
        path = run_dir / LOCK
        created = (not run_dir.exists(), not path.exists())
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise io_error(path, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            deadline = time.monotonic() + 2.0
            while not holder and time.monotonic() < deadline:  # it holds the lock and writes its name just after
                time.sleep(0.05)
                holder = _holder(fd)
            holder = holder or "another process (which has not written its pid yet)"
            os.close(fd)
            raise RunDirBusy(f"trainer.run_dir: {str(run_dir)!r} is in use by {holder}; wait for that run to "
                             "end (or stop it), or choose another trainer.run_dir") from None
        left = _holder(fd)
        if left:
            logger.info(f"trainer.run_dir: the lock left by {left}, a run that is gone, is taken over")
        previous = os.pread(fd, 4096, 0)
        made_data = not (run_dir / DATA).exists() and not staging_dir(run_dir / DATA).exists()
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info + b"\n", 0)
        os.fsync(fd)
        return cls(run_dir, fd, created, previous, made_data)

    def release(self, restore: bool = False) -> None:
        """Let go, leaving the file empty (a later run then has nothing to take over); with ``restore``, as it was
        before this run took it (a refused start-up leaves a dead holder's details in place)."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
            if restore and self.previous:
                os.pwrite(self.fd, self.previous, 0)
                os.fsync(self.fd)
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1

    def abandon(self) -> None:
        """Release after a start-up that failed, undoing what it made: the synthetic task it wrote under data/,
        the lock file and the run directory it created; a lock file that was there says what it said before.
        The run leaves no trace for the next one to trip on."""
        self.release(restore=True)
        made_dir, made_file = self.created
        if self.made_data:
            for folder in (self.run_dir / DATA, staging_dir(self.run_dir / DATA)):
                shutil.rmtree(folder, ignore_errors=True)
        try:
            if made_file:
                (self.run_dir / LOCK).unlink()
            if made_dir:
                self.run_dir.rmdir()
        except OSError:
            pass

    def close(self, exc_type, exc, tb) -> bool:
        """An exit callback for the run's ``contextlib.ExitStack``: a failure before ``started`` abandons the
        directory (``abandon``), anything else releases it. Never swallows the exception."""
        if exc_type is not None and not self.started:
            self.abandon()
        else:
            self.release()
        return False

    def move_to(self, run_dir: Path) -> None:
        """Hold ``run_dir``'s lock instead (where the run now lives, after --overwrite moved the old one aside
        with its lock file): the same object, so whoever releases or abandons it acts on the new one."""
        new = RunDirLock.acquire(run_dir)
        self.release(restore=True)  # the old run keeps its lock file as it was
        self.run_dir, self.fd, self.created = new.run_dir, new.fd, new.created
        self.previous, self.made_data = new.previous, new.made_data


def _holder(fd: int) -> str:
    """'pid N on host H (since T)' from a lock file, or '' when it names nobody."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"pid {info['pid']} on host {info['host']} (since {info['since']})"
    except (ValueError, TypeError, KeyError, OSError):
        return ""


def check_run_dir(run_dir: Path, resume, overwrite: bool, rank: int) -> Path | None:
    """What a run may do with ``run_dir``, decided before anything is written (every rank calls it).

    Fresh run: the directory must be absent or hold no earlier run, unless ``overwrite`` (the old one
    is then moved aside, never deleted: ``prepare_run_dir``). ``resume``: True for the newest checkpoint, or
    a checkpoint directory, which must exist and read back. Returns the checkpoint to resume from, or None
    when ``resume`` is True and there is none yet (a run stopped before its first checkpoint, or before it
    created ``run_dir``): it starts from step 0, said on rank 0.
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
        if path is None and resume is True:
            # a requeued job runs the same `--resume` each time, also after a kill before the first checkpoint
            # or before the run directory existed (verl's resume_mode: auto)
            if rank == 0:
                why = ("has no checkpoint yet (the run stopped before its first)" if _holds_a_run(run_dir)
                       else "holds no run yet (a first attempt stopped before it started)")
                logger.info(f"--resume: {str(run_dir)!r} {why}; it starts from step 0")
            return None
        if path is None:
            raise CheckpointError(f"--resume: no checkpoint under {str(ckpt_root)!r}")
        check_checkpoint(path, rank)
        return path
    if run_dir.is_dir() and not overwrite:
        held = _holds_a_run(run_dir)
        if held:
            raise CheckpointError(f"trainer.run_dir: {str(run_dir)!r} already holds a run ({', '.join(held[:3])}"
                                  f"{', ...' if len(held) > 3 else ''}); continue it with --resume, move it "
                                  "aside with --overwrite, or choose another trainer.run_dir")
    return None


def _holds_a_run(run_dir: Path) -> list[str]:
    """What of an earlier run ``run_dir`` holds (names beyond the regenerable ones), sorted."""
    return sorted(p.name for p in run_dir.iterdir() if p.name not in REGENERABLE) if run_dir.is_dir() else []


def prepare_run_dir(run_dir: Path, overwrite: bool) -> Path | None:
    """Rank 0: move an existing run aside (``--overwrite``), create the directory. Returns where the
    old run went, if anywhere."""
    moved = None
    if overwrite and run_dir.is_dir() and any(p.name not in REGENERABLE for p in run_dir.iterdir()):
        moved = move_aside(run_dir)
        logger.info(f"--overwrite: the previous run in {run_dir} was moved to {moved}")
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


def hold_run_dir(run_dir: Path, rank: int) -> RunDirLock | None:
    """Rank 0 takes the run directory's lock before anything is written; every rank stops with its one-line
    error when it cannot (another live run holds the directory, or it cannot be written)."""
    lock, why, kind = None, "", ""
    if rank == 0 and not (run_dir.exists() and not run_dir.is_dir()):  # a file: check_run_dir says so
        try:
            lock = RunDirLock.acquire(run_dir)
        except UserError as exc:
            why, kind = str(exc), type(exc).__name__
    why, kind = broadcast_text(why), broadcast_text(kind)
    if why:
        raise (RunDirBusy if kind == RunDirBusy.__name__ else UserError)(why)
    return lock


def save_is_due(minutes: float | None, last_save: float, rank: int, device: Any) -> bool:
    """``trainer.save_every_minutes`` since the last checkpoint (rank 0's clock decides for every rank)."""
    if not minutes:
        return False
    due = rank == 0 and time.monotonic() - last_save >= 60.0 * minutes
    return all_max(int(due), device) > 0
