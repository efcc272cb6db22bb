"""The optional packages a run's config needs, checked before the run writes anything.

A config that asks for vLLM rollouts (``rollout.engine: vllm``), LoRA (``model.lora_rank``: peft) or a 4-bit base
(``model.quantization: 4bit``: bitsandbytes) on a machine without the package stops here with one line naming the
key, the package and the extra to install, instead of a traceback from deep inside start-up after the run
directory was written. Looked up without importing (``importlib.util.find_spec``); an installed package that
then fails to import still fails later, and start-up undoes what it wrote (``RunDirLock.abandon``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable

from fastcov.errors import MissingPackage


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def needed_packages(cfg) -> list[tuple[str, str, str]]:
    """(config setting, import name, pip extra) of every optional package ``cfg`` needs."""
    need = []
    if cfg.rollout.engine == "vllm":
        need.append(("rollout.engine=vllm", "vllm", "vllm"))
    if int(cfg.model.lora_rank or 0) > 0:
        need.append((f"model.lora_rank={cfg.model.lora_rank}", "peft", "lora"))
    if cfg.model.quantization == "4bit":
        need.append(("model.quantization=4bit", "bitsandbytes", "lora"))
    return need


def check_optional_packages(cfg, version_checks: dict[str, Callable[[str], object]] | None = None) -> None:
    """Raise ``MissingPackage`` (a one-line user error, exit 2) for the first optional package ``cfg`` needs that
    is not installed. ``version_checks``: import name -> a check of the installed version (pip's metadata) that
    raises RuntimeError naming the supported range (the rollout room's ``check_vllm_version`` for vLLM)."""
    for setting, module, extra in needed_packages(cfg):
        if not _installed(module):
            raise MissingPackage(f"{setting} needs the package {module!r}, which is not installed: "
                                 f"pip install 'fastcov[{extra}]'")
        check = (version_checks or {}).get(module)
        if check is None:
            continue
        try:
            check(importlib.metadata.version(module))
        except importlib.metadata.PackageNotFoundError:
            pass  # importable but not pip-installed (a source tree): its __version__ is checked at import
        except RuntimeError as exc:
            raise MissingPackage(str(exc)) from None
