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


def check_optional_packages(cfg) -> None:
    """Raise ``MissingPackage`` (a one-line user error, exit 2) for the first optional package ``cfg`` needs that
    is not installed, or for an installed vLLM outside the supported range."""
    for setting, module, extra in needed_packages(cfg):
        if not _installed(module):
            raise MissingPackage(f"{setting} needs the package {module!r}, which is not installed: "
                                 f"pip install 'fastcov[{extra}]'")
        if module == "vllm":
            from fastcov.trainer.rollout.vllm_api import check_vllm_version

            try:
                check_vllm_version(importlib.metadata.version("vllm"))
            except importlib.metadata.PackageNotFoundError:
                pass  # importable but not pip-installed (a source tree): its __version__ is checked at import
            except RuntimeError as exc:
                raise MissingPackage(str(exc)) from None
