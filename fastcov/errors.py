"""The errors a user can fix, and how one is shown.

``fastcov.cli`` prints a ``UserError`` as one line and exits with its ``exit_code``; the library and the
trainer raise it without importing the CLI (``fastcov.cli`` re-exports these names).
"""

from __future__ import annotations


class UserError(Exception):
    """A failure the user caused and can fix: ``str(exc)`` names the argument, key or file and what to do.

    The CLI prints it as one line (no traceback) and exits with ``exit_code``: 2 for usage errors (bad
    arguments, config values, input files), 1 for a run that cannot continue (e.g. a failed rollout
    engine). Library callers catch it like any exception; subclasses also derive from the builtin they
    refine (``ConfigError`` is a ``ValueError``, a missing data file a ``FileNotFoundError``).
    """

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A bad config key or value; the message names the dotted key (the CLI prints it, exit status 2)."""


class UsageError(UserError):
    """A bad command line (argparse's complaint)."""


class MissingPackage(UserError, ImportError):
    """An optional package the config asks for (vLLM, peft, bitsandbytes) is not installed or not a supported
    version; the message names the setting and the extra to install (exit status 2)."""


def one_line(message: object) -> str:
    """``message`` as a single line (later lines of a multi-line message are joined with ' | ')."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    return " | ".join(lines) if lines else "error"
