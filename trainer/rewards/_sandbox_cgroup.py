"""A memory cgroup per sandboxed call, where the trainer can make one (trainer/rewards/sandbox.py).

The cgroup counts everything the program and its forks hold (heap, page cache, the work dir's tmpfs, pipes,
kernel memory) against ``memory_mb`` in total, and the kernel's own counter of OOM kills in it says whether the
program hit that limit. It is made under the trainer's own cgroup of the memory hierarchy: cgroup v1's memory
controller, or v2 where the trainer's cgroup hands the memory controller to its children. A trainer that may not
create one there (not root, no delegation, v2's rule that a cgroup with processes has no controllers for its
children) runs without: then each process is held to ``memory_mb`` of address space (RLIMIT_AS) and a program that
runs out gets a MemoryError that the kernel does not report, so its status is ``error``.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "fastcov-sbx-"
_names = itertools.count()
_names_lock = threading.Lock()


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root within the hierarchy, mount point, fs type, super options) of every cgroup mount."""
    out: list[tuple[str, str, str, str]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        f, g = left.split(), right.split()
        if len(f) >= 5 and len(g) >= 3 and g[0] in ("cgroup", "cgroup2"):
            out.append((f[3], f[4].replace("\\040", " "), g[0], g[2]))
    return out


def own_memory_cgroup() -> tuple[int, Path] | None:
    """(version, folder) of the memory cgroup this process is in, as mounted here; None if there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    mounts = _mounts()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            version, want = 2, lambda fs, opts: fs == "cgroup2"
        elif "memory" in controllers.split(","):
            version, want = 1, lambda fs, opts: fs == "cgroup" and "memory" in opts.split(",")
        else:
            continue
        for root, point, fs, opts in mounts:
            if want(fs, opts) and (path == root or path.startswith(root.rstrip("/") + "/")):
                folder = Path(point) / path[len(root.rstrip("/")):].lstrip("/")
                try:
                    if version == 1 or "memory" in (folder / "cgroup.subtree_control").read_text().split():
                        return version, folder
                except OSError:
                    pass
    return None


@dataclass
class MemoryCgroup:
    version: int
    path: Path

    @property
    def procs(self) -> str:
        return str(self.path / "cgroup.procs")

    @classmethod
    def create(cls, version: int, parent: Path, limit_bytes: int) -> MemoryCgroup:
        """A fresh cgroup under ``parent`` holding at most ``limit_bytes`` (no swap); OSError if it cannot be."""
        with _names_lock:
            n = next(_names)
        path = parent / f"{PREFIX}{os.getpid()}-{threading.get_ident() % 100000}-{n}"
        path.mkdir(mode=0o755)
        cg = cls(version, path)
        try:
            if version == 1:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                cg._try("memory.swappiness", "0")
            else:
                (path / "memory.max").write_text(str(limit_bytes))
                cg._try("memory.swap.max", "0")
                cg._try("memory.oom.group", "1")
        except OSError:
            cg.remove()
            raise
        return cg

    def _try(self, name: str, value: str) -> None:
        try:
            (self.path / name).write_text(value)
        except OSError:
            pass  # absent on this kernel, or no swap to turn off

    def _field(self, name: str, key: str) -> int:
        try:
            for line in (self.path / name).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def oom_kills(self) -> int:
        """Processes the kernel killed in this cgroup for its memory limit."""
        return self._field("memory.oom_control" if self.version == 1 else "memory.events", "oom_kill")

    def peak_bytes(self) -> int | None:
        try:
            return int((self.path / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"))
                       .read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def remove(self, wait_s: float = 2.0) -> None:
        """rmdir, retried while the kernel finishes taking the program's processes down."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return  # left for remove_stale of a later process
                time.sleep(0.01)


def remove_stale(parent: Path) -> None:
    """Remove the cgroups of sandboxes whose trainer process is gone (it was killed mid-call)."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for p in entries:
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+-\d+", p.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            MemoryCgroup(0, p).remove(wait_s=0)
        except OSError:
            pass


def usable_cgroup() -> tuple[int, Path] | None:
    """(version, parent folder) where this process can make a sandbox's memory cgroup, probed by making one."""
    found = own_memory_cgroup()
    if found is None:
        return None
    version, parent = found
    remove_stale(parent)
    try:
        MemoryCgroup.create(version, parent, 64 << 20).remove()
    except OSError:
        return None
    return version, parent
