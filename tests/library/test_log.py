"""fastcov's own messages through ``logging``: ``[fastcov] message``, stdout below WARNING and stderr from it, rank 0
only unless a record says it concerns every rank, the level from FASTCOV_LOG_LEVEL (the CLI's --quiet / --verbose)."""

from __future__ import annotations

import logging

import pytest

from fastcov import log


@pytest.fixture
def fastcov_log(monkeypatch):
    """A module logger under ``fastcov``, the level and rank environment restored afterwards."""
    monkeypatch.setenv(log.LEVEL_ENV, "INFO")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(log.RANKS_ENV, raising=False)
    log.configure()
    yield logging.getLogger("fastcov.trainer.some_module")
    monkeypatch.undo()  # the environment as it was, then the logger's level from it
    log.configure()


def test_the_format_and_the_streams(fastcov_log, capsys):
    fastcov_log.info("run %s: %d prompts", "runs/x", 4)
    fastcov_log.warning("removed the stale build lock x")
    fastcov_log.info("\nCtrl-C: finishing this step")
    fastcov_log.debug("not at INFO")
    out, err = capsys.readouterr()
    assert out == "[fastcov] run runs/x: 4 prompts\n\n[fastcov] Ctrl-C: finishing this step\n"
    assert err == "[fastcov] removed the stale build lock x\n"


def test_rank_zero_only_unless_every_rank_or_a_warning(fastcov_log, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    fastcov_log.info("rank 3's progress")
    fastcov_log.info("the HF copy of host h is on rank 3", extra=log.EVERY_RANK)
    fastcov_log.warning("rank 3 lost its peer")
    out, err = capsys.readouterr()
    assert out == "[fastcov] the HF copy of host h is on rank 3\n" and err == "[fastcov] rank 3 lost its peer\n"
    monkeypatch.setenv(log.RANKS_ENV, "all")
    fastcov_log.info("rank 3's progress")
    assert capsys.readouterr().out == "[fastcov] rank 3's progress\n"


@pytest.mark.parametrize("level,shown", [("WARNING", ["w"]), ("DEBUG", ["d", "i", "w"]), ("INFO", ["i", "w"])])
def test_the_level_follows_the_environment_and_set_verbosity(fastcov_log, capsys, monkeypatch, level, shown):
    import os

    log.set_verbosity(level)
    assert os.environ[log.LEVEL_ENV] == level  # what a worker process started now reads in its log.configure()
    fastcov_log.debug("d")
    fastcov_log.info("i")
    fastcov_log.warning("w")
    out, err = capsys.readouterr()
    assert [ln.removeprefix("[fastcov] ") for ln in (out + err).splitlines()] == shown
    monkeypatch.setenv(log.LEVEL_ENV, "nonsense")
    assert log.configure().level == logging.INFO
    with pytest.raises(ValueError, match="level must be one of"):
        log.set_verbosity("loud")


def test_an_application_can_take_the_records_over(fastcov_log, caplog):
    logger = logging.getLogger("fastcov")
    handlers = list(logger.handlers)
    logger.handlers.clear()
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="fastcov"):
            fastcov_log.info("to the application's handler")
        assert [r.getMessage() for r in caplog.records] == ["to the application's handler"]
    finally:
        logger.handlers[:] = handlers
        logger.propagate = False
