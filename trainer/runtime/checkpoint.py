"""Atomic checkpoints: ``<run>/checkpoints/step_000010/`` appears only when complete and on disk.

Layout of one checkpoint::

    step_000010/
        ds/...                 DeepSpeed: model, optimizer (ZeRO partitions, one file set per rank)
        trainer_state.json     step, data position, counters, lambda schedule, written by rank 0
        rng_rank{r}.pt         python / numpy / torch / sampling and selection generator states, per rank,
                               as tensors and plain values only (read back with ``weights_only=True``)

Saving is two collective phases so that the trainer can make its metrics durable in between:

1. ``write_checkpoint``: everything goes into ``.tmp_step_000010`` and is fsynced (files and folders);
2. ``publish_checkpoint``: rank 0 fsyncs anything it added in between, renames it to ``step_000010``,
   fsyncs ``checkpoints/``, then retires all but the newest ``keep_last`` (renamed to ``.del_*`` first,
   so a crash mid-delete never leaves a half-deleted directory under a checkpoint's name).

A crash at any moment leaves the previous checkpoints untouched; leftovers (``.tmp_*``, ``.del_*``) are
removed by the next save. Every file of a checkpoint is untrusted input when it is read back: JSON is
parsed as data, ``.pt`` files are loaded with ``weights_only=True`` (DeepSpeed's files included), and a
damaged or incomplete checkpoint raises ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastcov.errors import UserError

_STEP_RE = re.compile(r"^step_(\d{6,})$")


class CheckpointError(UserError):
    """A checkpoint (or the run directory it belongs to) that cannot be used; the message names the path."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under ``ckpt_root``, oldest first."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir()
             if p.is_dir() and (m := _STEP_RE.match(p.name)) and (p / "trainer_state.json").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    cks = list_checkpoints(ckpt_root)
    return cks[-1] if cks else None


# --------------------------------------------------------------------------------------------- durability

def fsync_path(path: Path) -> None:
    """fsync one file or directory (directories: their entries, i.e. renames and creations in them)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself), deepest first."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                fsync_path(p)
        fsync_path(Path(dirpath))


# Fault-injection seam (tests/trainer/loop/test_reliability.py, tests/trainer/e2e/test_fault_injection.py): each
# hook is called as hook(path, stage) with stage "written" (the temporary file is on disk, the old file untouched)
# and "replaced" (the rename is done). Nothing in fastcov registers one.
REWRITE_HOOKS: list = []


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` all at once: temp file, fsync, rename, fsync the folder. Every rewrite of
    a run file goes through here, so a kill at any moment leaves the old file or the new one, whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    for hook in REWRITE_HOOKS:
        hook(path, "written")
    os.replace(tmp, path)
    fsync_path(path.parent)
    for hook in REWRITE_HOOKS:
        hook(path, "replaced")


# --------------------------------------------------------------------------------------------- RNG state

def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """All RNG states as tensors and plain values (loadable with ``torch.load(weights_only=True)``)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64),
                   "gauss": None if gauss is None else float(gauss)},
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in generators.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in generators.items():
        if k not in state["generators"]:
            raise CheckpointError(f"resume: the checkpoint has no state for the {k!r} generator")
        g.set_state(state["generators"][k])


# --------------------------------------------------------------------------------------------- saving

def _remove_leftovers(ckpt_root: Path) -> None:
    for p in ckpt_root.iterdir():
        if p.is_dir() and p.name.startswith((".tmp_step_", ".del_step_")):
            shutil.rmtree(p, ignore_errors=True)


def write_checkpoint(ckpt_root: Path, step: int, policy_engine, trainer_state: dict[str, Any],
                     generators: dict[str, torch.Generator], rank: int) -> Path:
    """Phase 1 (collective): write and fsync the checkpoint into ``.tmp_step_XXXXXX``; returns that path."""
    import torch.distributed as dist

    tmp = Path(ckpt_root) / f".tmp_{step_dir_name(step)}"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(ckpt_root)
        tmp.mkdir()
    dist.barrier()
    policy_engine.save(str(tmp))
    torch.save(rng_state(generators), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:  # written last: its presence marks a checkpoint complete (list_checkpoints)
        with open(tmp / "trainer_state.json", "wb") as f:
            f.write(json.dumps(trainer_state, indent=1).encode())
            f.flush()
            os.fsync(f.fileno())
    fsync_tree(tmp)  # each rank its own files (and, harmlessly, the others')
    dist.barrier()
    return tmp


def publish_checkpoint(tmp: Path, keep_last: int, rank: int) -> Path:
    """Phase 2 (collective): rename ``tmp`` to its final name, make the rename durable, retire old ones."""
    import torch.distributed as dist

    tmp = Path(tmp)
    final = tmp.with_name(tmp.name[len(".tmp_"):])
    if rank == 0:
        # files rank 0 added to tmp after write_checkpoint (e.g. an extra model's state) are synced too;
        # fsync of the already-synced ones is cheap
        fsync_tree(tmp)
        root = tmp.parent
        old = None
        if final.exists():  # a step saved again after resuming from an older checkpoint
            old = root / f".del_{final.name}"
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        fsync_path(root)
        retired = [old] if old is not None else []
        for p in list_checkpoints(root)[:-keep_last]:
            dead = root / f".del_{p.name}"
            p.rename(dead)
            retired.append(dead)
        if retired:
            fsync_path(root)
        for p in retired:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def save_checkpoint(ckpt_root: Path, step: int, policy_engine, trainer_state: dict[str, Any],
                    generators: dict[str, torch.Generator], rank: int, keep_last: int) -> Path:
    """Collective: every rank calls it. Both phases in one; returns the final checkpoint directory."""
    tmp = write_checkpoint(ckpt_root, step, policy_engine, trainer_state, generators, rank)
    return publish_checkpoint(tmp, keep_last, rank)


# --------------------------------------------------------------------------------------------- loading

def read_trainer_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint, checked; raises CheckpointError naming what is wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"--resume: {str(path)!r} does not exist; give a checkpoint directory "
                              "(<run_dir>/checkpoints/step_XXXXXX) or --resume alone for the newest")
    if not path.is_dir():
        raise CheckpointError(f"--resume: {str(path)!r} is not a checkpoint directory")
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        raise CheckpointError(f"--resume: {str(path)!r} is not a complete checkpoint (no trainer_state.json)")
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"--resume: {str(state_file)!r} is damaged ({type(exc).__name__}); "
                              "resume from an older checkpoint") from None
    need = {"step": int, "sampler": dict, "counters": dict}
    if not isinstance(state, dict) or any(not isinstance(state.get(k), t) for k, t in need.items()) \
            or isinstance(state["step"], bool) or state["step"] < 0:
        raise CheckpointError(f"--resume: {str(state_file)!r} lacks a valid step/sampler/counters; "
                              "resume from an older checkpoint")
    return state


def _read_rng(rng_file: Path) -> dict[str, Any]:
    if not rng_file.is_file():
        raise CheckpointError(f"--resume: {str(rng_file)!r} missing (was the run saved with another world size?)")
    try:
        state = torch.load(rng_file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not {"python", "numpy", "torch", "generators"} <= set(state):
            raise ValueError("missing keys")
        return state
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise CheckpointError(f"--resume: {str(rng_file)!r} is damaged or not a fastcov RNG file "
                              f"({type(exc).__name__}); resume from an older checkpoint") from None


def check_checkpoint(path: Path, rank: int = 0) -> dict[str, Any]:
    """Cheap checks before anything is written: trainer state and this rank's RNG file read back."""
    state = read_trainer_state(path)
    _read_rng(Path(path) / f"rng_rank{rank}.pt")
    return state


# Plain data classes DeepSpeed pickles into its ZeRO optimizer files; the weights-only unpickler may
# rebuild these (and only these) besides tensors and builtin containers. Named, never imported from data.
_DEEPSPEED_DATA_CLASSES = (
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
)


def _deepspeed_safe_globals() -> list:
    import importlib

    found = []
    for module, name in _DEEPSPEED_DATA_CLASSES:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


@contextlib.contextmanager
def _weights_only_loads(policy_engine):
    """DeepSpeed's own loader unpickles any object; route its reads through ``weights_only=True``
    (with DeepSpeed's own data classes allowed), so a checkpoint from elsewhere cannot run code."""
    ce = getattr(getattr(policy_engine, "engine", None), "checkpoint_engine", None)
    if ce is None or not hasattr(ce, "load"):
        yield
        return
    allowed = _deepspeed_safe_globals()

    scoped = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    if scoped is None:
        torch.serialization.add_safe_globals(allowed)

    def load(path, map_location=None):
        with scoped(allowed) if scoped is not None else contextlib.nullcontext():
            return torch.load(path, map_location=map_location, weights_only=True)

    ce.load = load
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del ce.load  # back to the class's method


def load_checkpoint(path: Path, policy_engine, generators: dict[str, torch.Generator],
                    rank: int) -> dict[str, Any]:
    """Restore model + optimizer (DeepSpeed), RNG states; return the trainer state dict."""
    path = Path(path)
    state = read_trainer_state(path)
    rng = _read_rng(path / f"rng_rank{rank}.pt")
    try:
        with _weights_only_loads(policy_engine):
            policy_engine.load(str(path))
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - DeepSpeed raises many kinds on a damaged file
        raise CheckpointError(f"--resume: the model/optimizer files under {str(path / 'ds')!r} cannot be "
                              f"loaded ({type(exc).__name__}: {str(exc)[:200]}); resume from an older "
                              "checkpoint") from None
    try:
        set_rng_state(rng, generators)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds on a damaged RNG state; one user-facing error
        raise CheckpointError(f"--resume: {str(path / f'rng_rank{rank}.pt')!r} holds no usable RNG state "
                              f"({type(exc).__name__})") from None
    return state
