"""The shipped run configs, importable as ``fastcov.configs`` so that ``importlib.resources`` finds the same
YAML files in a checkout and in an installed wheel.

``resolve_config`` is how every command reads a config argument: a file on disk as given, else the shipped
config of that name (``configs/demo.yaml``, ``demo.yaml`` or ``demo``), wherever the command runs from."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

PREFIX = "configs/"


def shipped_config(name: str) -> Path:
    """The shipped config ``name`` (e.g. "demo.yaml", "studies/hard-task.yaml")."""
    return Path(str(files(__name__).joinpath(name)))


def shipped_names() -> list[str]:
    """The shipped configs' names without ``.yaml`` (``studies/hard-task`` for the studies), sorted."""
    root = shipped_config("")
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def resolve_config(path: str | Path) -> Path:
    """``path`` as given when it exists or is absolute; else the shipped config it names: ``configs/X.yaml`` (what
    the README and the study files write), ``X.yaml`` or ``X``. A name found nowhere comes back as given, for the
    loader to name."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    text = p.as_posix()
    text = text[len(PREFIX):] if text.startswith(PREFIX) else text
    for name in (text, f"{text}.yaml") if p.suffix == "" else (text,):
        if name and ".." not in Path(name).parts:
            shipped = shipped_config(name)
            if shipped.is_file():
                return shipped
    return p
