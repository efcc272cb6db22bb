"""The run's log: ``<run>/config.yaml`` and the metric sinks, ``<run>/metrics.jsonl`` (always) and the trackers of
``trainer.report_to`` (TensorBoard, W&B, MLflow, ...: runtime/trackers.py)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

from fastcov.trainer.runtime.checkpoint import write_atomic
from fastcov.trainer.runtime.run_dir import CONFIG, io_error, metrics_path
from fastcov.trainer.runtime.trackers import close_trackers, log_to_trackers, open_trackers, report_to_names


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsLogger:
    """Rank 0 only. ``log(record)`` appends one JSON line and forwards its numbers to the trackers."""

    def __init__(self, run_dir: Path, config: dict, report_to: list[str] | tuple[str, ...] = (),
                 project: str = "fastcov", resume_step: int | None = None):
        self.path = metrics_path(run_dir)
        # A resumed run's file was already cut back to its checkpoint, atomically (run_dir.trim_metrics):
        # rewriting it here again would open a window in which a kill empties it.
        if resume_step is None and self.path.exists():
            self.path.unlink()
        self._f = open(self.path, "a")
        try:
            self.trackers = open_trackers(list(report_to), run_dir, project, config)
        except BaseException:
            self._f.close()
            raise

    def log(self, record: dict[str, Any]) -> None:
        rec = {k: _clean(v) for k, v in record.items()}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        step = rec.get("step", 0)
        nums = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        log_to_trackers(self.trackers, nums, step)

    def close(self) -> None:
        self._f.close()
        close_trackers(self.trackers)


def open_run_files(run_dir: Path, config: dict, t: Any, resume_step: int | None,
                   closing: contextlib.ExitStack) -> MetricsLogger:
    """Rank 0: config.yaml (rewritten atomically) and the metrics log; one line if the directory refuses.
    ``t``: the run's ``trainer`` section; ``resume_step``: the step a resumed run starts after, else None."""
    import yaml

    try:
        write_atomic(run_dir / CONFIG, yaml.safe_dump(config, sort_keys=False).encode())
        logger = MetricsLogger(run_dir, config, report_to_names(t.report_to), t.project, resume_step=resume_step)
    except OSError as exc:
        raise io_error(getattr(exc, "filename", None) or run_dir, exc) from None
    closing.callback(logger.close)
    return logger
