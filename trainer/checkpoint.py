"""Atomic checkpoints: ``<run>/checkpoints/step_000010/`` appears only when complete.

Layout of one checkpoint::

    step_000010/
        ds/...                 DeepSpeed: model, optimizer (ZeRO partitions, one file set per rank)
        trainer_state.json     step, data position, counters, lambda schedule, written by rank 0
        rng_rank{r}.pt         python / numpy / torch / sampling and selection generator states, per rank

Everything is written into ``.tmp_step_000010`` first; rank 0 renames it once all ranks are done, then
deletes all but the newest ``keep_last``. A crash mid-save leaves the previous checkpoints untouched.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_RE = re.compile(r"^step_(\d{6,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under ``ckpt_root``, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    cks = list_checkpoints(ckpt_root)
    return cks[-1] if cks else None


def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in generators.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in generators.items():
        if k not in state["generators"]:
            raise KeyError(f"resume: the checkpoint has no state for the {k!r} generator")
        g.set_state(state["generators"][k])


def save_checkpoint(ckpt_root: Path, step: int, policy_engine, trainer_state: dict[str, Any],
                    generators: dict[str, torch.Generator], rank: int, keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    import torch.distributed as dist

    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp_{step_dir_name(step)}"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    policy_engine.save(str(tmp))
    torch.save(rng_state(generators), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        with open(tmp / "trainer_state.json", "w") as f:
            json.dump(trainer_state, f, indent=1)
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(ckpt_root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: Path, policy_engine, generators: dict[str, torch.Generator],
                    rank: int) -> dict[str, Any]:
    """Restore model + optimizer (DeepSpeed), RNG states; return the trainer state dict."""
    path = Path(path)
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"resume: {str(path)!r} is not a complete checkpoint (no trainer_state.json)")
    policy_engine.load(str(path))
    rng_file = path / f"rng_rank{rank}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"resume: {str(rng_file)!r} missing (was the run saved with another world size?)")
    set_rng_state(torch.load(rng_file, weights_only=False), generators)
    with open(state_file) as f:
        return json.load(f)
