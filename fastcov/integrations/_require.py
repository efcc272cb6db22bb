"""A clear error when an integration's framework is not installed."""

from __future__ import annotations

import importlib


def require(module: str, integration: str, install: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"fastcov.integrations.{integration} needs {module!r}, which is not installed "
            f"({exc}). Install it with: pip install {install}"
        ) from exc
