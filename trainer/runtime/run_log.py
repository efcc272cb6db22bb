"""The run's log: ``<run>/config.yaml`` and the metric sinks, ``<run>/metrics.jsonl`` (always), TensorBoard and
W&B (when installed and enabled)."""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

from fastcov.trainer.runtime.checkpoint import write_atomic
from fastcov.trainer.runtime.run_dir import CONFIG, io_error, metrics_path


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsLogger:
    """Rank 0 only. ``log(record)`` appends one JSON line and forwards numbers to the optional sinks."""

    def __init__(self, run_dir: Path, config: dict, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "fastcov", resume_step: int | None = None):
        self.path = metrics_path(run_dir)
        # A resumed run's file was already cut back to its checkpoint, atomically (run_dir.trim_metrics):
        # rewriting it here again would open a window in which a kill empties it.
        if resume_step is None and self.path.exists():
            self.path.unlink()
        self._f = open(self.path, "a")
        self.tb = None
        self.wb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                warnings.warn("trainer.tensorboard: tensorboard is not installed; skipping", stacklevel=2)
        if wandb:
            try:
                import wandb as _wandb

                self.wb = _wandb.init(project=wandb_project, dir=str(run_dir), config=config,
                                      name=Path(run_dir).name, resume="allow")
            except ImportError:
                warnings.warn("trainer.wandb: wandb is not installed; skipping", stacklevel=2)

    def log(self, record: dict[str, Any]) -> None:
        rec = {k: _clean(v) for k, v in record.items()}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        step = rec.get("step", 0)
        nums = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log(nums, step=step)

    def close(self) -> None:
        self._f.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def open_run_files(run_dir: Path, config: dict, t: Any, resume_step: int | None,
                   closing: contextlib.ExitStack) -> MetricsLogger:
    """Rank 0: config.yaml (rewritten atomically) and the metrics log; one line if the directory refuses.
    ``t``: the run's ``trainer`` section; ``resume_step``: the step a resumed run starts after, else None."""
    import yaml

    try:
        write_atomic(run_dir / CONFIG, yaml.safe_dump(config, sort_keys=False).encode())
        logger = MetricsLogger(run_dir, config, t.tensorboard, t.wandb, t.wandb_project, resume_step=resume_step)
    except OSError as exc:
        raise io_error(getattr(exc, "filename", None) or run_dir, exc) from None
    closing.callback(logger.close)
    return logger
