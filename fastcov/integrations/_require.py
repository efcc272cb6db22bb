"""One-line errors when an integration's framework is missing or of a version it was not written for."""

from __future__ import annotations

import importlib
import re


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '1.16.0', '0.29.1.dev0' or '2.0.0rc1'."""
    parts = re.findall(r"\d+", version.split("+")[0])[:3]
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts))


def require(module: str, integration: str, install: str, *, minimum: str | None = None, below: str | None = None):
    """Import ``module`` for ``fastcov.integrations.<integration>``; ImportError in one line naming the
    install command (``install``, e.g. "'fastcov[hf]'") when it is missing or outside [minimum, below)."""
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"fastcov.integrations.{integration} needs {module.split('.')[0]}, which cannot be imported "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): pip install {install}"
        ) from exc
    if minimum is not None or below is not None:
        top = importlib.import_module(module.split(".")[0])
        found = str(getattr(top, "__version__", "0"))
        wanted = ",".join(part for part in (minimum and f">={minimum}", below and f"<{below}") if part)
        too_old = minimum is not None and _release(found) < _release(minimum)
        too_new = below is not None and _release(found) >= _release(below)
        if too_old or too_new:
            raise ImportError(
                f"fastcov.integrations.{integration} needs {top.__name__}{wanted}, found {top.__name__} {found}: "
                f"pip install {install}"
            )
    return imported
