"""Names that moved out of a module: ``module.NAME`` still gives the object, with a one-line FutureWarning
naming its new home (the way the trainer's config treats a moved key; docs/api.md, "What is stable")."""

from __future__ import annotations

import importlib
import warnings


def moved_attribute(module: str, name: str, homes: dict[str, str]) -> object:
    """For a module's ``__getattr__``: ``name`` from ``homes[name]`` (a module's dotted name), with a FutureWarning
    attributed to the caller's line; an AttributeError for any other name. A home outside the installed package
    (bench/, in a checkout of the repository) that does not import is an AttributeError saying where it went."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} is deprecated: use {home}.{name}", FutureWarning, stacklevel=3)
    try:
        owner = importlib.import_module(home)
    except ImportError:
        raise AttributeError(f"{module}.{name} moved out of the library to {home}.{name}, the repository's "
                             f"{home.replace('.', '/')}.py: use it from a checkout of fastcov") from None
    return getattr(owner, name)
