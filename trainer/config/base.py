"""What every section module shares: the ``_check`` that raises ConfigError naming a key, and a field's YAML key."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastcov.errors import ConfigError


def check(cond: bool, key: str, msg: str) -> None:
    """Raise ``ConfigError("<key>: <msg>")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def without_name(exc: Exception, name: str) -> str:
    """The library's message without its leading argument name: the config key that replaces it says which."""
    msg = str(exc)
    return msg[len(name) + 1:] if msg.startswith(name + " ") else msg


def config_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and overrides: its name, or ``metadata["key"]`` where the key is a Python keyword
    (``rollout.async`` is the attribute ``async_mode``)."""
    return f.metadata.get("key", f.name)


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f): to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj

