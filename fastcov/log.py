"""fastcov's own messages through the standard library's ``logging``: the ``fastcov`` logger and its children
(``logging.getLogger(__name__)`` in each module), written as ``[fastcov] message``.

Messages below WARNING go to stdout, warnings and errors to stderr, each stream looked up as the record is
written (so a redirected ``sys.stdout`` follows). In a multi-rank job only rank 0 (``RANK``) shows messages below
WARNING, except those logged with ``extra=EVERY_RANK`` (a line each node's first rank must say);
``FASTCOV_LOG_RANKS=all`` shows every rank's. The level comes from ``FASTCOV_LOG_LEVEL`` (DEBUG, INFO, WARNING,
ERROR; default INFO), which ``set_verbosity`` (the CLI's ``--verbose`` / ``--quiet``) sets, so that worker
processes started afterwards follow it.

An application with its own logging set-up takes fastcov's records over with
``logging.getLogger("fastcov").handlers.clear()`` and ``logging.getLogger("fastcov").propagate = True``.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["EVERY_RANK", "LEVEL_ENV", "RANKS_ENV", "configure", "set_verbosity"]

ROOT = "fastcov"
LEVEL_ENV = "FASTCOV_LOG_LEVEL"
RANKS_ENV = "FASTCOV_LOG_RANKS"
EVERY_RANK = {"every_rank": True}  # logger.info(..., extra=EVERY_RANK): shown on every rank, not rank 0 only
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankFilter(logging.Filter):
    """Rank 0's records; every rank's warnings and errors, and the records marked ``EVERY_RANK``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING or getattr(record, "every_rank", False)
                or os.environ.get(RANKS_ENV, "").lower() == "all" or _rank() == 0)


class ConsoleHandler(logging.Handler):
    """stdout below WARNING, stderr from WARNING, flushed at once (a killed run keeps what it said)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a failed write is reported, never raised
            self.handleError(record)


class TagFormatter(logging.Formatter):
    """``[fastcov] message``; a message's leading newlines stay in front of the tag."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        body = text.lstrip("\n")
        return f"{text[: len(text) - len(body)]}[{ROOT}] {body}"


def _level_from_env() -> int:
    name = os.environ.get(LEVEL_ENV, "INFO").strip().upper()
    return getattr(logging, name) if name in LEVELS else logging.INFO


def configure() -> logging.Logger:
    """The ``fastcov`` logger with its console handler (installed once; ``import fastcov`` calls this)."""
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, ConsoleHandler) for h in logger.handlers):
        handler = ConsoleHandler()
        handler.setFormatter(TagFormatter("%(message)s"))
        handler.addFilter(RankFilter())
        logger.addHandler(handler)
        logger.propagate = False  # not twice where the application logs the root logger to the console too
    logger.setLevel(_level_from_env())
    return logger


def set_verbosity(level: str) -> None:
    """DEBUG, INFO, WARNING or ERROR for fastcov's messages, in this process and the processes it starts."""
    name = level.upper()
    if name not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    os.environ[LEVEL_ENV] = name
    logging.getLogger(ROOT).setLevel(getattr(logging, name))
