"""``trainer.report_to``: the run's metrics to TensorBoard, W&B, MLflow, ... through accelerate's trackers
(``accelerate.tracking``, the layer TRL and every ``Accelerator(log_with=...)`` use), beside metrics.jsonl.

Rank 0 opens them (``MetricsLogger``), each with ``main_process_only`` off (the caller is already the one process
that logs; accelerate's process state joins the process group the run started, with no collective). Where each
writes: TensorBoard ``<run_dir>/tensorboard``;
W&B ``<run_dir>/wandb``, project ``trainer.project``, run named after the run directory; MLflow the experiment
``trainer.project`` at MLFLOW_TRACKING_URI (default ./mlruns); the others their own defaults, project
``trainer.project``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# metric-name characters a tracker refuses -> what replaces them (MLflow: letters, digits, _ - . / and space)
KEY_FIXES: dict[str, dict[str, str]] = {"mlflow": {"@": "_at_"}}


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The nested run config as ``{"algo.mode": "kl_cov", ...}`` with scalar values (lists as text): what
    hyperparameter tables (TensorBoard's hparams, MLflow's params) take."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = str(list(value))
        else:
            out[name] = value
    return out


def report_to_names(report_to: str | list[str]) -> list[str]:
    """trainer.report_to as tracker names, each once ("none" and [] are none; "all": every installed tracker)."""
    names = [n for n in ([report_to] if isinstance(report_to, str) else report_to) if n != "none"]
    if "all" in names:
        from accelerate.tracking import get_available_trackers

        names = [n for n in names if n != "all"] + [str(t) for t in get_available_trackers()]
    return list(dict.fromkeys(names))


def _tracker(name: str, run_dir: Path, project: str):
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    cls = LOGGER_TYPE_TO_CLASS[name]
    if name == "tensorboard":
        return cls("tensorboard", str(run_dir))  # events in <run_dir>/tensorboard
    if name == "wandb":
        return cls(project, dir=str(run_dir), name=run_dir.name, resume="allow")
    if name == "mlflow":
        return cls(project, run_name=run_dir.name)
    if getattr(cls, "requires_logging_directory", False):
        return cls(project, str(run_dir))
    return cls(project)


def open_trackers(names: list[str], run_dir: str | Path, project: str, config: dict[str, Any]) -> list[Any]:
    """Started trackers (``accelerate.tracking.GeneralTracker``) for ``names``, the run config stored in each."""
    trackers: list[Any] = []
    if not names:
        return trackers
    from accelerate import PartialState

    PartialState()  # accelerate's process state, which its trackers' logging needs; it joins the group already started
    try:
        for name in names:
            tracker = _tracker(name, Path(run_dir), project)
            tracker.main_process_only = False  # rank 0 alone calls this: no asking accelerate which rank is main
            tracker.start()
            trackers.append(tracker)
            tracker.store_init_configuration(flat_config(config))
    except BaseException:
        close_trackers(trackers)
        raise
    return trackers


def tracker_values(name: str, values: dict[str, float]) -> dict[str, float]:
    """``values`` with the metric names tracker ``name`` accepts (KEY_FIXES)."""
    fixes = KEY_FIXES.get(name)
    if not fixes:
        return values
    out = {}
    for key, value in values.items():
        for bad, good in fixes.items():
            key = key.replace(bad, good)
        out[key] = value
    return out


def log_to_trackers(trackers: list[Any], values: dict[str, float], step: int) -> None:
    for tracker in trackers:
        tracker.log(tracker_values(tracker.name, values), step=step)


def close_trackers(trackers: list[Any]) -> None:
    for tracker in trackers:
        tracker.finish()
