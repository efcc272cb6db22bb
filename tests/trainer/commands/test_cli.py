"""The `fastcov` command as users type it: flags anywhere among the overrides, `--version`, `python -m fastcov`,
configs found in the installed package, `model.path` replacing the file's `model.arch`."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _dist import without_rank_environment  # noqa: E402
from _fixtures import ROOT, TINY  # noqa: E402

from fastcov.cli import main  # noqa: E402


@pytest.fixture
def train_calls(monkeypatch):
    """`fastcov train` up to the trainer: the (config, resume, overwrite) it would train with."""
    import fastcov.trainer.train as train_mod

    calls = []
    monkeypatch.setattr(train_mod, "train", lambda cfg, resume=False, overwrite=False: calls.append(
        (cfg, resume, overwrite)))
    return calls


@pytest.mark.parametrize("argv,steps,resume,overwrite", [
    (["--resume", "trainer.max_steps=6"], 6, True, False),  # was: --resume: 'trainer.max_steps=6' does not exist
    (["--overwrite", "trainer.max_steps=5"], 5, False, True),  # was: unrecognized arguments
    (["trainer.max_steps=3", "--overwrite", "trainer.progress=true"], 3, False, True),
    (["--resume", "--overwrite", "trainer.max_steps=4", "algo.mode=kl_cov"], 4, True, True),
    (["trainer.max_steps=7", "--resume"], 7, True, False),
])
def test_flags_anywhere_among_the_overrides(train_calls, argv, steps, resume, overwrite):
    assert main(["train", str(TINY), *argv]) == 0
    (cfg, got_resume, got_overwrite), = train_calls
    assert (cfg.trainer.max_steps, got_resume, got_overwrite) == (steps, resume, overwrite)
    assert cfg.algo.mode == ("kl_cov" if "algo.mode=kl_cov" in argv else "clip_cov")


def test_resume_still_takes_a_checkpoint_directory(train_calls, tmp_path):
    ckpt = tmp_path / "step=3"  # a path that exists is a checkpoint, even with '=' in its name
    ckpt.mkdir()
    assert main(["train", str(TINY), "--resume", str(ckpt), "trainer.max_steps=2"]) == 0
    assert train_calls[0][1] == str(ckpt) and train_calls[0][0].trainer.max_steps == 2
    assert main(["train", str(TINY), f"--resume={tmp_path / 'ck'}"]) == 0
    assert train_calls[1][1] == str(tmp_path / "ck")  # not there: train() names it (tests/trainer/loop)


def test_version(capsys):
    import fastcov

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fastcov {fastcov.__version__}"


def test_python_dash_m_fastcov():
    import fastcov

    env = without_rank_environment("FASTCOV_DEBUG")
    res = subprocess.run([sys.executable, "-m", "fastcov", "--version"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == f"fastcov {fastcov.__version__}", res.stderr
    res = subprocess.run([sys.executable, "-m", "fastcov", "train", "tiny", "optim.lr=.inf"], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 2 and res.stderr.strip() == "fastcov train: optim.lr: must be a finite number, got inf"


# ------------------------------------------------------------------------------- configs from the package

@pytest.mark.parametrize("name", ["configs/tiny.yaml", "tiny.yaml", "tiny"])
def test_a_shipped_config_by_name_from_any_directory(train_calls, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the package's copy (fastcov.configs)
    assert main(["train", name, "trainer.max_steps=1"]) == 0
    assert train_calls[0][0].model.arch["hidden_size"] == 32 and train_calls[0][0].trainer.max_steps == 1


def test_a_file_on_disk_wins_over_the_shipped_one(train_calls, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text(TINY.read_text().replace("max_steps: 2", "max_steps: 9"))
    assert main(["train", "configs/tiny.yaml"]) == 0
    assert train_calls[0][0].trainer.max_steps == 9


def test_a_config_found_nowhere_lists_the_shipped_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiyn.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastcov train: config file 'tiyn.yaml' does not exist") and "tiny" in err, err


# ----------------------------------------------------------------------------- model.path replaces model.arch

def test_model_path_override_replaces_the_files_arch_and_tokenizer(tmp_path):
    from fastcov.trainer.config import load_config

    cfg = load_config(TINY, [f"model.path={tmp_path}"])  # was: set exactly one of model.path and model.arch
    assert cfg.model.path == str(tmp_path) and cfg.model.arch is None and cfg.model.tokenizer is None
    cfg = load_config(TINY, [f"model.path={tmp_path}", "model.tokenizer=other/tok"])  # one given stays
    assert cfg.model.tokenizer == "other/tok"
    cfg = load_config(TINY, [f"model.path={tmp_path}", "model.arch=null", "model.tokenizer=null"])  # the old way
    assert cfg.model.arch is None and cfg.model.tokenizer is None
    with pytest.raises(ValueError, match="set exactly one of model.path"):
        load_config(TINY, [f"model.path={tmp_path}", "model.arch.hidden_size=64"])  # both asked for: refused


def test_a_file_with_both_is_still_refused(tmp_path):
    from fastcov.trainer.config import load_config

    path = tmp_path / "both.yaml"
    path.write_text(TINY.read_text().replace("model:\n", f"model:\n  path: {tmp_path}\n"))
    with pytest.raises(ValueError, match="set exactly one of model.path"):
        load_config(path)


# ----------------------------------------------------------------------------------------------- eval --k

@pytest.mark.parametrize("flags,sample_all", [
    (["--k", "4"], True),  # was: greedy sources got one sample, and pass@4 / mean@4 were never reported
    (["--k", "1"], False),  # avg@1: greedy where the papers are greedy
    (["--k", "4", "--greedy-sources"], False),
    (["--k", "1", "--sample-all"], True),
])
def test_eval_k_samples_every_prompt_k_times(tmp_path, monkeypatch, capsys, flags, sample_all):
    from fastcov.trainer import evaluation

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "v.parquet").write_bytes(b"")
    seen = {}

    def fake_evaluate_model(model, data, **kw):
        seen.update(kw)
        return {"prompts": 1, "k": kw["k"], "val_acc": 0.5}

    monkeypatch.setattr(evaluation, "evaluate_model", fake_evaluate_model)
    assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "v.parquet"), *flags]) == 0
    assert seen["sample_all"] is sample_all and seen["k"] == int(flags[1])
    assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "v.parquet"), "--sample-all",
                 "--greedy-sources"]) == 2
    assert "--sample-all and --greedy-sources" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- --quiet / --verbose

@pytest.mark.parametrize("flag,shown", [("--quiet", ["w"]), ("--verbose", ["d", "i", "w"]), (None, ["i", "w"])])
def test_quiet_and_verbose_anywhere(monkeypatch, capsys, flag, shown):
    import logging

    import fastcov.trainer.train as train_mod
    from fastcov import log

    monkeypatch.setenv(log.LEVEL_ENV, "INFO")
    log.configure()
    progress = []

    def fake_train(cfg, resume=False, overwrite=False):
        progress.append(cfg.trainer.progress)
        for level, text in ((logging.DEBUG, "d"), (logging.INFO, "i"), (logging.WARNING, "w")):
            logging.getLogger("fastcov.trainer.start").log(level, text)

    monkeypatch.setattr(train_mod, "train", fake_train)
    try:
        assert main(["train", "tiny", "trainer.max_steps=1", *([flag] if flag else []), "trainer.progress=true"]) == 0
    finally:
        monkeypatch.undo()  # FASTCOV_LOG_LEVEL as it was (set_verbosity wrote it), then the logger's level from it
        log.configure()
    out, err = capsys.readouterr()
    assert [ln.removeprefix("[fastcov] ") for ln in (out + err).splitlines()] == shown
    assert progress == [flag != "--quiet"]  # --quiet hides the progress bar too
    assert main(["--quiet", "--verbose", "plan", "--model", "qwen2.5-0.5b"]) == 2
    assert "--quiet and --verbose contradict each other" in capsys.readouterr().err
