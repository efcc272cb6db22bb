"""The phases of a run on a time axis (``trainer.timeline``): every ``timed`` phase of the trainer and every busy
span of an asynchronous run's engine, written per step to ``<run>/timeline.jsonl`` as rows
``{"step", "lane", "phase", "start", "end"}`` (seconds since the run started; rank 0's). ``bench.async`` draws
the picture in docs/async.md from it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class Timeline:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.t0 = time.perf_counter()
        self.spans: list[tuple[str, str, float, float]] = []
        self.lock = threading.Lock()  # the engine's spans come from its background thread

    def add(self, lane: str, phase: str, start: float, end: float) -> None:
        with self.lock:
            self.spans.append((lane, phase, start - self.t0, end - self.t0))

    def flush(self, step: int) -> None:
        with self.lock:
            spans, self.spans = self.spans, []
        with open(self.path, "a") as f:
            for lane, phase, start, end in spans:
                f.write(json.dumps({"step": step, "lane": lane, "phase": phase, "start": round(start, 6),
                                    "end": round(end, 6)}) + "\n")


_ACTIVE: list[Timeline] = []  # the run's, while it records


def open_timeline(path: Path) -> Timeline:
    _ACTIVE[:] = [Timeline(path)]
    return _ACTIVE[0]


def close_timeline() -> None:
    _ACTIVE.clear()


def timeline_span(lane: str, phase: str, start: float, end: float) -> None:
    """Record a span (perf_counter seconds) when a timeline is open; otherwise nothing."""
    if _ACTIVE:
        _ACTIVE[0].add(lane, phase, start, end)


def flush_timeline(step: int) -> None:
    """Write the spans recorded since the last flush as ``step``'s rows."""
    if _ACTIVE:
        _ACTIVE[0].flush(step)
