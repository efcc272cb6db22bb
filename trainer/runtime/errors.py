"""How a run stops: when something outside the loop fails, the error classes the ``fastcov train`` command turns
into one line and an exit status, and the one sentence that names the last intact checkpoint; on Ctrl-C, after the
step (``StopFlag``)."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastcov.errors import ConfigError, UserError, one_line
from fastcov.trainer.runtime.checkpoint import latest_checkpoint
from fastcov.trainer.runtime.distributed import lost_peer

logger = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    pass


class LostRankError(UserError):
    """A collective failed because another rank went away (its host died, its process was killed) or did not
    answer within ``trainer.collective_timeout_s``: the run stops, exit status 1, naming the lost rank and
    the last intact checkpoint, from which every host resumes."""

    exit_code = 1


class RunIOError(UserError):
    """A run file that cannot be written mid-run (disk full, permissions): the run stops, exit status 1,
    with the path and the last intact checkpoint; nothing published is damaged."""

    exit_code = 1


def user_error(exc: ValueError) -> Exception:
    """model.py / engine.py raise ValueError naming the config key for a bad model, tokenizer or device:
    those are the user's to fix (one line on the CLI); anything else stays what it was."""
    msg = str(exc)
    if msg.startswith(("model.", "trainer.device")):
        return ConfigError(msg.splitlines()[0][:500])
    return exc


def unreadable_model(path: str, exc: BaseException) -> ValueError | None:
    """A ``from_pretrained(path)`` failure that the model directory's own files explain, as the ValueError naming
    ``model.path`` that ``user_error`` turns into one line: an unreadable or invalid file (OSError: config.json
    that is not JSON, a missing shard), damaged or truncated weights (safetensors' SafetensorError, a torch pickle
    that does not unpickle), weights whose shapes do not fit config.json, a config transformers refuses (a model
    type it does not know). None for anything else (out of memory, a bug), which keeps its traceback."""
    kind = type(exc).__name__
    msg = one_line(exc)
    if isinstance(exc, OSError):
        why = msg
    elif kind in ("SafetensorError", "UnpicklingError") or (isinstance(exc, RuntimeError) and (
            "PytorchStreamReader" in msg or "invalid header" in msg)):
        why = f"damaged or truncated weights ({kind}: {msg}); copy or export the model again"
    elif isinstance(exc, RuntimeError) and ("mismatched_sizes" in msg or "size mismatch" in msg):
        why = f"its weights do not fit its config.json ({msg[:300]})"
    elif isinstance(exc, ValueError):  # how transformers refuses a config (an unknown model type, a bad field)
        why = msg[:300]
    else:
        return None
    return ValueError(f"model.path: cannot load {path!r}: {why}")


def last_intact(ckpt_root: Path) -> str:
    """The newest published checkpoint under ``ckpt_root``, as the error messages name it ('none' if none).
    Temporary checkpoints are never published, so a published one is intact."""
    last = latest_checkpoint(ckpt_root)
    return str(last) if last else "none"


@contextlib.contextmanager
def lost_rank_exit(run: Any) -> Iterator[None]:
    """A collective that fails for a lost peer becomes a ``LostRankError``; any other error stays what it was.
    ``run``: the loop's Run (its rank, its current step and checkpoint folder)."""
    try:
        yield
    except RuntimeError as exc:
        who = lost_peer(exc, run.rank)
        if who is None:
            raise
        raise LostRankError(f"lost {who} (at step {run.step}); the last intact checkpoint is "
                            f"{last_intact(run.ckpt_root)}; start every host again with --resume") from None


@contextlib.contextmanager
def run_io(run: Any, what: str) -> Iterator[None]:
    """An OSError while writing ``what`` stops the run with one line: the path, why, the last intact
    checkpoint (temporary checkpoints are never published, so nothing published is damaged)."""
    try:
        yield
    except OSError as exc:
        raise RunIOError(f"{what}: cannot write {str(getattr(exc, 'filename', None) or run.run_dir)!r} "
                         f"({exc.strerror or exc}); the last intact checkpoint is "
                         f"{last_intact(run.ckpt_root)}; fix the disk, then --resume") from None


class StopFlag:
    """SIGINT sets a flag the loop checks between steps; a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.set = False
        self._old = None

    def __enter__(self):
        def handler(signum, frame):
            if self.set:
                raise KeyboardInterrupt
            self.set = True
            logger.info("\nCtrl-C: finishing this step, saving a checkpoint, exiting "
                        "(press again to abort without saving)")

        try:
            self._old = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
