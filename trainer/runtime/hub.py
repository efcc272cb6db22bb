"""A run's model on the Hugging Face Hub (``fastcov push RUN_DIR --repo ID``, ``trainer.push_to_hub``), through
``huggingface_hub``: one commit with ``final/`` (model and tokenizer, or a LoRA run's adapter), the run's config as
``fastcov_config.yaml`` and, unless ``final/`` has one, a README.md model card. The token is huggingface_hub's
(``HF_TOKEN``, or ``hf auth login``); ``HF_ENDPOINT`` points it at another Hub."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fastcov.errors import UserError
from fastcov.trainer.runtime.run_dir import CONFIG, read_metrics

REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # name, or namespace/name (huggingface_hub checks the rest)
CARD_METRICS = ("val_acc", "val_pass@1", "entropy", "reward_mean")


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def model_folder(path: str | Path) -> tuple[Path, Path | None]:
    """(the folder to upload, the run directory or None) for a run directory (its ``final/``) or a model directory
    (a run's ``final/`` or any other); a run without ``final/`` is a one-line error."""
    p = Path(path)
    if (p / "final").is_dir() and is_model_dir(p / "final"):
        return p / "final", p
    if p.is_dir() and is_model_dir(p):
        return p, p.parent if (p.parent / CONFIG).is_file() else None
    if (p / CONFIG).is_file():
        raise UserError(f"RUN_DIR: {str(p)!r} has no final/ yet (a run writes it when it reaches trainer.max_steps); "
                        "finish the run (fastcov train ... --resume) or push a model directory")
    raise UserError(f"RUN_DIR: {str(p)!r} is neither a run directory with final/ nor a model directory "
                    "(config.json or adapter_config.json)")


def model_card(repo_id: str, run_dir: Path | None) -> str:
    """A short README.md: front matter the Hub reads (tags, the base model), what trained it, the last metrics."""
    import yaml

    cfg: dict[str, Any] = yaml.safe_load((run_dir / CONFIG).read_text()) or {} if run_dir is not None else {}
    model, algo = cfg.get("model") or {}, cfg.get("algo") or {}
    mode, estimator = algo.get("mode", "vanilla"), algo.get("adv_estimator", "grpo")
    front: dict[str, Any] = {"library_name": "peft" if model.get("lora_rank") else "transformers",
                             "tags": ["fastcov", "reinforcement-learning", estimator, mode]}
    base = model.get("path")
    if isinstance(base, str) and base.count("/") == 1 and not Path(base).exists():
        front["base_model"] = base  # a Hub id, not a local directory
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {repo_id.rsplit('/', 1)[-1]}", ""]
    if run_dir is None:
        return "\n".join([*lines, "Trained with fastcov."]) + "\n"
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    steps = max((r.get("step", 0) for r in rows), default=0)
    lines.append(f"Trained with fastcov: `algo.mode: {mode}`, `algo.adv_estimator: {estimator}`, "
                 f"{steps} step{'s' * (steps != 1)} from `{base or 'a fresh model (model.arch)'}`. "
                 "The run's config: `fastcov_config.yaml`.")
    last = {k: (r["step"], r[k]) for r in rows for k in CARD_METRICS if isinstance(r.get(k), (int, float))}
    if last:
        lines += ["", "| metric | step | value |", "|---|---:|---:|"]
        lines += [f"| {k} | {step} | {value:.4f} |" for k, (step, value) in last.items()]
    return "\n".join(lines) + "\n"


def push_to_hub(path: str | Path, repo_id: str, *, private: bool | None = None,
                commit_message: str | None = None) -> str:
    """Upload a run's ``final/`` (``path``: the run directory or a model directory) to Hub repo ``repo_id``,
    created if missing, in one commit; returns the commit's URL. Failures of the Hub (no or a refused token, an
    unreachable endpoint) are a one-line ``UserError``."""
    if not REPO_ID.fullmatch(repo_id):
        raise UserError(f"--repo: {repo_id!r} is not a Hub repo id (namespace/name)")
    folder, run_dir = model_folder(path)
    try:
        from huggingface_hub import CommitOperationAdd, HfApi
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:
        raise UserError("pushing needs huggingface_hub: pip install 'fastcov[train]'") from None
    api = HfApi()
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    ops = [CommitOperationAdd(path_in_repo=f.relative_to(folder).as_posix(), path_or_fileobj=str(f)) for f in files]
    if not (folder / "README.md").is_file():
        ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=model_card(repo_id, run_dir).encode()))
    if run_dir is not None:
        ops.append(CommitOperationAdd(path_in_repo="fastcov_config.yaml", path_or_fileobj=str(run_dir / CONFIG)))
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        info = api.create_commit(repo, operations=ops,
                                 commit_message=commit_message or f"fastcov: upload {folder.name}")
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = " (log in with `hf auth login` or set HF_TOKEN)" if status in (401, 403) else ""
        raise UserError(f"the Hub at {api.endpoint} refused the upload to {repo_id!r}: HTTP {status}: "
                        f"{_server_message(exc)}{hint}") from None
    except _transport_errors() as exc:
        raise UserError(f"cannot reach the Hub at {api.endpoint} ({type(exc).__name__}: {exc}); check the network "
                        "or HF_ENDPOINT") from None
    return info.commit_url


def _transport_errors() -> tuple[type[BaseException], ...]:
    """A failed connection, in whichever HTTP library this huggingface_hub uses (httpx2, httpx or requests)."""
    import importlib

    errors: list[type[BaseException]] = [OSError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def _server_message(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    try:
        return str(response.json().get("error")) if response is not None else str(exc).splitlines()[0]
    except (ValueError, AttributeError, json.JSONDecodeError):
        return str(exc).splitlines()[0]
