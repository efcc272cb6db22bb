"""trainer.report_to: the run's metrics through accelerate's trackers (TensorBoard writing real event files here),
the old trainer.tensorboard / trainer.wandb booleans still accepted with a FutureWarning, clear errors for an
unknown or missing tracker, and a tracker registered by a trainer.imports module. Two ranks:
tests/trainer/e2e/test_trackers_e2e.py."""

from __future__ import annotations

import math
import warnings

import pytest
from _fixtures import TINY  # noqa: E402

from fastcov.trainer.config import ConfigError, load_config  # noqa: E402

BASE = ["reward.sandbox=inline", "trainer.eval_every=2", "trainer.max_steps=2"]


def test_a_run_writes_tensorboard_event_files_with_the_metrics(tmp_path):
    pytest.importorskip("tensorboard", reason="the [tensorboard] extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fastcov.trainer import train as train_mod
    from fastcov.trainer.runtime.run_dir import read_metrics

    run = train_mod.train(load_config(TINY, [f"trainer.run_dir={tmp_path / 'run'}", *BASE,
                                             "trainer.report_to=[tensorboard]"]))
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]  # the step-0 evaluation, then two steps
    for key in ("entropy", "reward_mean", "val_acc", "val_pass@1"):
        logged = {r["step"]: r[key] for r in rows if isinstance(r.get(key), (int, float))}
        scalars = {e.step: e.value for e in events.Scalars(key)}
        assert scalars.keys() == logged.keys(), key
        for step, value in logged.items():  # TensorBoard stores float32: a relative 2^-24
            assert math.isclose(scalars[step], value, rel_tol=2**-23, abs_tol=1e-30), (key, step)
    # the run config as hyperparameters: accelerate writes hparams.yml into a directory of its own, beside the one
    # of add_hparams' event file (both named by time.time(), so their listing order is arbitrary)
    hparams = [d / "hparams.yml" for d in (run / "tensorboard").iterdir() if (d / "hparams.yml").is_file()]
    assert len(hparams) == 1 and "algo.mode: clip_cov" in hparams[0].read_text()


@pytest.mark.parametrize("old,report_to", [("trainer.tensorboard=true", ["tensorboard"]),
                                           ("trainer.tensorboard=false", [])])
def test_the_old_booleans_still_work_with_a_one_line_warning(old, report_to, monkeypatch):
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["tensorboard", "wandb"])
    with pytest.warns(FutureWarning) as caught:
        cfg = load_config(TINY, [old])
    assert cfg.trainer.report_to == report_to
    messages = [str(w.message) for w in caught if w.category is FutureWarning]
    assert messages == ["trainer.tensorboard is deprecated: use trainer.report_to: [tensorboard]"]
    with pytest.warns(FutureWarning, match="use trainer.report_to: \\[wandb\\]"):
        cfg = load_config(TINY, ["trainer.wandb=true", "trainer.report_to=[tensorboard]"])
    assert cfg.trainer.report_to == ["tensorboard", "wandb"]
    with pytest.warns(FutureWarning, match="trainer.wandb_project is deprecated: use trainer.project"):
        assert load_config(TINY, ["trainer.wandb_project=mine"]).trainer.project == "mine"
    with pytest.raises(ConfigError, match="trainer.wandb_project: renamed trainer.project, which is set too"):
        load_config(TINY, ["trainer.wandb_project=a", "trainer.project=b"])
    with pytest.raises(ConfigError, match="trainer.tensorboard: expected true/false"):
        load_config(TINY, ["trainer.tensorboard=yes please"])


def test_no_warning_without_the_old_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert load_config(TINY).trainer.report_to == []


def test_unknown_and_missing_trackers_are_one_line_errors(monkeypatch):
    import accelerate.tracking

    with pytest.raises(ConfigError, match="trainer.report_to: unknown tracker 'tensorbord'; accelerate's: tensorboard"):
        load_config(TINY, ["trainer.report_to=[tensorbord]"])
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    with pytest.raises(ConfigError, match=r"trainer.report_to: tensorboard is not installed: pip install "
                                          r"'fastcov\[tensorboard\]'"):
        load_config(TINY, ["trainer.report_to=tensorboard"])
    with pytest.raises(ConfigError, match="trainer.report_to: mlflow is not installed: pip install mlflow"):
        load_config(TINY, ["trainer.report_to=[mlflow]"])
    assert load_config(TINY, ["trainer.report_to=none"]).trainer.report_to == "none"


TRACKER_MODULE = '''
from accelerate.tracking import GeneralTracker, register_tracker_class

CALLS = []


class Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self, run_name, **kwargs):
        super().__init__()
        self.run_name = run_name

    @property
    def tracker(self):
        return self

    def start(self):
        CALLS.append(("start", self.run_name))

    def store_init_configuration(self, values):
        CALLS.append(("config", values))

    def log(self, values, step=None, **kwargs):
        CALLS.append(("log", step, values))

    def finish(self):
        CALLS.append(("finish",))


register_tracker_class(Recorder)
'''


def test_a_tracker_registered_by_trainer_imports(tmp_path, monkeypatch):
    """Without accelerate's process state (main_process_only off), with the run config flattened and the metrics
    of every row."""
    import importlib

    import accelerate.tracking

    from fastcov.trainer.runtime.run_log import MetricsLogger

    monkeypatch.setitem(accelerate.tracking.LOGGER_TYPE_TO_CLASS, "recorder", None)  # restored afterwards
    (tmp_path / "my_tracker.py").write_text(TRACKER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="already registered"):  # the placeholder above is replaced
        cfg = load_config(TINY, ["trainer.imports=[my_tracker]", "trainer.report_to=[recorder]",
                                 "trainer.project=proj"])
    calls = importlib.import_module("my_tracker").CALLS
    logger = MetricsLogger(tmp_path, cfg.to_dict(), ["recorder"], cfg.trainer.project)
    logger.log({"step": 1, "entropy": 0.5, "val_pass@1": 0.25, "note": "text", "done": True})
    logger.close()
    assert calls[0] == ("start", "proj")
    assert calls[1][0] == "config" and calls[1][1]["algo.mode"] == "clip_cov"
    assert calls[1][1]["data.train_files"] == "[]" and calls[1][1]["model.arch.hidden_size"] == 32
    assert calls[2:] == [("log", 1, {"step": 1, "entropy": 0.5, "val_pass@1": 0.25}), ("finish",)]


def test_metric_names_a_tracker_refuses_are_rewritten():
    from fastcov.trainer.runtime.trackers import report_to_names, tracker_values

    values = {"val_pass@4": 0.5, "sel/jaccard_vs_cov": 0.1}
    assert tracker_values("mlflow", values) == {"val_pass_at_4": 0.5, "sel/jaccard_vs_cov": 0.1}
    assert tracker_values("tensorboard", values) == values
    assert report_to_names("none") == [] and report_to_names(["wandb", "wandb"]) == ["wandb"]
    assert report_to_names("tensorboard") == ["tensorboard"]
