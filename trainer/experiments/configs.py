"""Where the shipped configs are (the package ``fastcov.configs``: ``configs/`` of a checkout, ``fastcov/configs/``
inside an installed wheel); kept here for the experiments that import it."""

from __future__ import annotations

from fastcov.configs import PREFIX, resolve_config, shipped_config, shipped_names

__all__ = ["PREFIX", "resolve_config", "shipped_config", "shipped_names"]
