"""Where the shipped configs are: ``configs/`` of a checkout, or ``fastcov/configs/`` inside an installed
wheel, both reached as the package ``fastcov.configs`` (pyproject.toml maps it and ships its YAML)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

PREFIX = "configs/"


def shipped_config(name: str) -> Path:
    """The shipped config ``name`` (e.g. "demo.yaml", "studies/hard-task.yaml")."""
    return Path(str(files("fastcov.configs").joinpath(name)))


def resolve_config(path: str | Path) -> Path:
    """``path`` as given when it exists or is absolute; else a ``configs/...`` path names a shipped config
    (what the README and the study files write, wherever the command runs from)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    text = p.as_posix()
    if text.startswith(PREFIX):
        shipped = shipped_config(text[len(PREFIX):])
        if shipped.exists():
            return shipped
    return p
