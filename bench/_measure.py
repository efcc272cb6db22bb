"""Timing and memory helpers for the kernel benchmark (no fastcov or peer imports here).

Timing
  CUDA: one pair of ``torch.cuda.Event`` around every iteration, a synchronize after the loop;
  CPU:  ``time.perf_counter`` around every iteration.
  Both: ``warmup`` untimed iterations first, the median of ``repeats`` timed ones is the headline.

Memory (the peak *increment* over what was allocated before the call: inputs excluded, outputs and
gradients that the call returns included)
  CUDA: ``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated() - memory_allocated()``
        (the caching allocator's reserved-but-free blocks do not count).
  CPU:  peak resident set size of the process. Each case runs in a fresh subprocess; for the
        memory phase glibc's mmap threshold is pinned at 64 KiB (``mallopt``), so every tensor
        buffer is its own mmap that goes back to the OS on free: RSS then tracks live tensor memory
        instead of the malloc arena's high-water mark. ``/proc/self/clear_refs`` (write "5")
        resets VmHWM to the current RSS right before the measured call, VmHWM after it is the
        peak; where clear_refs cannot be written, the peak since process start is used (the
        method string in the result says which). For the timing phase the threshold goes to
        glibc's steady-state 32 MiB so buffers below it are reused without page faults, as in
        a long-running training process.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameter numbers


def set_malloc_mode(mode: str) -> bool:
    """glibc only: "measure" pins the mmap threshold at 64 KiB (RSS tracks live buffers),
    "time" at 32 MiB (the steady state glibc's dynamic threshold reaches). False elsewhere."""
    mmap_thr, trim_thr = {"measure": (64 << 10, 0), "time": (32 << 20, 64 << 20)}[mode]
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_thr) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, trim_thr) == 1 and ok
        return bool(ok)
    except (OSError, AttributeError):
        return False


# --------------------------------------------------------------------------- results


def append_jsonl(path, row: dict, default: Callable | None = None) -> None:
    """One JSON line appended to ``path``, flushed and fsynced (a run killed later keeps it)."""
    import json
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=default) + "\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- device / environment


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_slug(device: torch.device) -> str:
    """'nvidia-h100-80gb-hbm3' for CUDA, 'cpu-2core' for the CPU (cores this process may use)."""
    if device.type == "cuda":
        return slugify(torch.cuda.get_device_name(device))
    return f"cpu-{cpu_count()}core"


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or "unknown"


def env_info(device: torch.device) -> dict:
    info = {
        "device": device.type,
        "device_slug": device_slug(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "host_cpu": cpu_model(),
        "host_cores": cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001 - any import failure is just recorded
        info["triton"] = f"unavailable ({type(exc).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            device_memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
            capability=f"{props.major}.{props.minor}",
        )
    else:
        info["device_name"] = f"CPU ({cpu_model()}, {cpu_count()} cores)"
    return info


# --------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> list[float]:
    """Run ``fn`` warmup + repeats times; return the timed iterations in milliseconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def tflops(flops: float, ms: float | None) -> float | None:
    if not ms or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- memory


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def malloc_trim() -> bool:
    """Give free heap pages back to the OS (glibc); False elsewhere."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def hwm_bytes() -> int | None:
    kb = _status_kb("VmHWM")
    return None if kb is None else kb * 1024


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where that is not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakMemory:
    """Peak memory increment of one call, as a context manager: ``with PeakMemory(dev) as pm: ...``;
    read ``pm.peak_bytes`` after the block (keep the call's outputs alive inside the block)."""

    device: torch.device
    peak_bytes: int | None = None
    method: str = ""

    def __enter__(self) -> PeakMemory:
        free_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated - memory_allocated before"
        else:
            set_malloc_mode("measure")
            malloc_trim()  # free heap pages reused by the call must fault back in, i.e. show in RSS
            self._reset = reset_hwm()
            self._before = rss_bytes()
            self.method = ("peak RSS: VmHWM after clear_refs - VmRSS before" if self._reset
                           else "peak RSS: VmHWM since process start - VmRSS before (clear_refs not writable)")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.device.type == "cuda":
            if exc_type is None:
                torch.cuda.synchronize(self.device)
                self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._before
            return
        hwm = hwm_bytes()
        if exc_type is None and hwm is not None and self._before is not None:
            self.peak_bytes = max(0, hwm - self._before)
        set_malloc_mode("time")


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
