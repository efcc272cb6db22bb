"""DeepSpeed's JIT-built C++ ops and the lock torch's extension builder holds while it builds or checks one.

torch's builder (``torch.utils.cpp_extension.load``, which DeepSpeed's op builders call) creates
``<TORCH_EXTENSIONS_DIR>/<op>/lock`` with O_EXCL, keeps it open while it builds or checks the op, and removes it
when done. A process killed in between (SIGKILL from a scheduler's preemption or the OOM killer) leaves the file,
and every later load sleeps on it with no output, for ever. Two rules here:

* ``skip_shm_comm_op``: on CPU the trainer's collectives go through gloo; DeepSpeed's shared-memory op
  (``deepspeed_shm_comm``) only serves its inference all-reduce, so it is not loaded at all;
* ``take_over_stale_locks``: before an op is loaded (DeepSpeed's CPU Adam under ``trainer.offload_optimizer``),
  a lock that no live process holds open, at two looks a moment apart, is removed, whatever its age, with one
  line naming it, written before the lock goes (a kill in between leaves the line and the lock, which the next
  run takes over again).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_COMM_OP = "deepspeed_shm_comm"
# a lock that looks stale is looked at again after this long before it is removed (see take_over_stale_locks)
RECHECK_AFTER_S = 1.0


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-loading its shared-memory collectives when ``deepspeed.init_distributed`` starts
    gloo: nothing in training calls them, and their load is the start-up step that a kill can leave locked."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__  # probed once per process; DeepSpeed reads this same dict
    compatible[SHM_COMM_OP] = False


def extensions_roots() -> list[Path]:
    """The folders torch builds extensions in: ``TORCH_EXTENSIONS_DIR``, else every per-Python, per-accelerator
    folder under torch's default root (read, never created: torch's own resolver makes the op's folder)."""
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return [Path(os.environ["TORCH_EXTENSIONS_DIR"])]
    default = Path(get_default_build_root())
    return sorted(p for p in default.iterdir() if p.is_dir()) if default.is_dir() else []


def lock_holders(path: Path) -> list[int]:
    """PIDs of the processes with ``path`` open (Linux: read from /proc/*/fd); [] when none or when /proc is not
    readable."""
    target, pids = str(path.resolve()), []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    pids.append(int(entry.name))
                    break
            except OSError:
                continue
    return pids


def take_over_stale_locks(root: Path | None = None, now: float | None = None) -> list[Path]:
    """Remove every ``<root>/<op>/lock`` (``root``: default every folder of ``extensions_roots()``) that no live
    process holds open, at a first look and again RECHECK_AFTER_S later, whatever its age; says so in one line per
    lock, before removing it. Returns the locks removed. Does nothing where /proc cannot tell (not Linux).
    ``now``: the time of the first look, which the line's age is measured from (default: the clock)."""
    if not Path("/proc/self/fd").is_dir():
        return []
    roots = extensions_roots() if root is None else [root]
    now = time.time() if now is None else now
    candidates = []
    for lock in sorted(found for r in roots if r.is_dir() for found in r.glob("*/lock")):
        try:
            stat = lock.stat()
        except FileNotFoundError:
            continue
        if not lock_holders(lock):
            candidates.append((lock, stat))
    if candidates:
        # A look can fall where no holder shows though the lock is live: its creator between the open that made the
        # file and the fd table entry, or torch's builder between closing the lock and removing it. Either is over
        # a moment later (the holder shows, or the lock is gone); a lock its holder's death left is still there,
        # the same file, held by no one. No age rule: a lock planted a second ago is as stale as an old one.
        time.sleep(RECHECK_AFTER_S)
    removed = []
    for lock, stat in candidates:
        try:
            if lock.stat().st_ino != stat.st_ino or lock_holders(lock):  # released, or released and taken again
                continue
        except FileNotFoundError:
            continue
        age = now - stat.st_mtime
        # the line before the unlink: a run killed between the two has still said why the lock went
        logger.warning(f"removing the stale build lock {lock} (left {max(age, 0):.0f}s ago by a process that is "
                       "gone, e.g. a run killed during start-up)")
        try:
            lock.unlink()
        except FileNotFoundError:
            pass  # gone meanwhile: as good
        removed.append(lock)
    return removed
