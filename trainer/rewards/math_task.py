"""Verifiable rewards: the last \\boxed{} answer of a response, checked against the ground truth.

    fn = RewardFn(kind="binary", timeout_s=5.0)
    fn("... so \\boxed{\\frac{1}{2}}", "0.5")          # -> 1.0
    fn.batch(responses, truths)                       # -> [1.0, 0.0, ...], checked by a worker pool

Checking has three stages:

1. exact numbers: when both sides are integers, decimals (``0.25``, ``1e-3``) or fractions (``3/4``,
   ``\\frac{3}{4}``, ``-\\dfrac{1}{2}``), they are compared as exact rationals (``fractions.Fraction``), never
   through a float: ``\\boxed{9007199254740993}`` does not match 9007199254740992;
2. a normalised string comparison (instant, covers most other answers);
3. math-verify for mathematical equivalence, in a pool of worker processes (``sandbox="process"``, the
   default) with a hard per-answer limit of ``timeout_s``: a check that runs past it (e.g. ``10^{10^{10}}``,
   which can block inside C code where signals never fire) has its worker killed and scores wrong; a
   worker that dies is replaced and its answer retried once, so the rest of the batch is never lost.
   ``sandbox="inline"`` runs math-verify in the calling thread with its own signal-based limit.

``extract_boxed`` runs in time linear in the input (no nested rescans; 10 MB of braces takes well under
a second) and an answer longer than ``MAX_ANSWER_CHARS`` scores wrong without being parsed.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import re
import time
import warnings
from fractions import Fraction
from multiprocessing.connection import wait
from typing import Any

import numpy as np

MAX_ANSWER_CHARS = 10_000  # longer boxed answers score wrong unparsed (no sympy on megabytes)
_MAX_NUMBER_CHARS = 400  # exact-number parsing: longer literals (or exponents) go to math-verify
_BOX_RE = re.compile(rb"\\(?:boxed|fbox)")
_ARG_RE = re.compile(rb"[^\s$]+")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``.

    Braces nest: ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. An unclosed box is ignored; "last" is
    the complete box that starts last. Returns None when there is no complete box.

    Linear time: one vectorised pass computes the brace depth after every byte and the minimum depth of
    every suffix; a box opened at depth d is complete iff some later byte drops below d, and its end is
    found with one more scan. Boxes are tried from the last one back, each in O(1) until a complete
    one is found.
    """
    if not text:
        return None
    data = text.encode("utf-8", "surrogatepass")
    starts = [m.end() for m in _BOX_RE.finditer(data)]
    if not starts:
        return None
    buf = np.frombuffer(data, dtype=np.uint8)
    step = (buf == ord("{")).astype(np.int32) - (buf == ord("}")).astype(np.int32)
    depth = np.cumsum(step, dtype=np.int64)  # depth[k]: after byte k
    suffix_min = np.minimum.accumulate(depth[::-1])[::-1]  # min(depth[k:])
    n = len(data)
    for i in reversed(starts):
        if i >= n:
            continue
        c = data[i]
        if c == ord("{"):
            level = depth[i]  # after the opening brace
            if i + 1 < n and suffix_min[i + 1] < level:
                j = i + 1 + int(np.argmax(depth[i + 1 :] < level))  # the matching "}"
                return data[i + 1 : j].decode("utf-8", "surrogatepass").strip()
        elif c == ord(" "):
            # "\boxed 5": the argument runs to the next whitespace or "$".
            k = i
            while k < n and data[k] == ord(" "):
                k += 1
            arg = _ARG_RE.match(data, k)
            if arg:
                return arg.group(0).decode("utf-8", "surrogatepass").rstrip(".,")
    return None


# ------------------------------------------------------------------------------------------ comparison

_SPACE_RE = re.compile(r"\s+")
_TEXT_RE = re.compile(r"\\(?:text|mathrm)\{([^{}]*)\}")
_INT_OR_DEC = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?"
_NUMBER_RE = re.compile(rf"[+-]?{_INT_OR_DEC}")
_SLASH_RE = re.compile(rf"([+-]?)({_INT_OR_DEC})/({_INT_OR_DEC})")
_FRAC_RE = re.compile(rf"([+-]?)\\[dt]?frac\{{([+-]?{_INT_OR_DEC})\}}\{{([+-]?{_INT_OR_DEC})\}}")


def _normalise(s: str) -> str:
    """Whitespace, ``$``, ``\\text{}``, spacing commands and a trailing period removed (text only)."""
    s = s.strip().strip("$").strip()
    s = _TEXT_RE.sub(r"\1", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\left", "").replace("\\right", "")
    s = _SPACE_RE.sub("", s)
    return s.rstrip(".")


def as_rational(s: str) -> Fraction | None:
    """``s`` as an exact rational when it is an integer, a decimal or a fraction; else None.

    ``"0.1"`` is exactly 1/10, ``"9007199254740993"`` exactly that integer (no float round-trip).
    Literals longer than a few hundred characters are not parsed here (math-verify decides them).
    """
    s = _normalise(s)
    if not s or len(s) > _MAX_NUMBER_CHARS:
        return None
    try:
        if _NUMBER_RE.fullmatch(s):
            return Fraction(s)
        m = _SLASH_RE.fullmatch(s) or _FRAC_RE.fullmatch(s)
        if m:
            den = Fraction(m.group(3))
            if den == 0:
                return None
            value = Fraction(m.group(2)) / den
            return -value if m.group(1) == "-" else value
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def quick_verdict(answer: str, truth: str) -> bool | None:
    """True/False when exact numbers or normalised text decide; None when math-verify must."""
    a, t = as_rational(answer), as_rational(truth)
    if a is not None and t is not None:
        return a == t
    if _normalise(answer) == _normalise(truth):
        return True
    return None


def _math_verify(answer: str, truth: str, timeout_s: float | None) -> bool:
    from math_verify import parse, verify

    t = None if timeout_s is None else max(1, int(round(timeout_s)))
    kw = {} if t is None else {"parsing_timeout": t}
    gold = parse(f"${truth}$", **kw) if "\\boxed" not in truth else parse(truth, **kw)
    pred = parse(f"${answer}$", **kw)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=t))


# ------------------------------------------------------------------------------------------ worker pool

def _worker(conn) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import math_verify  # noqa: F401 - imported before "ready", so the first check is not charged for it
    except Exception:  # noqa: BLE001 - reported per check below
        pass
    conn.send("ready")
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        answer, truth, timeout_s = item
        try:
            ok = _math_verify(answer, truth, timeout_s)
        except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
            ok = False
        conn.send(bool(ok))


def _context():
    """forkserver where available: a clean server process (no threads, no CUDA) imports math-verify once
    and forks each worker from it, so replacing a killed worker takes milliseconds, not a fresh import."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["fastcov.trainer.rewards", "math_verify"])
        return ctx
    return mp.get_context("spawn")


class _Worker:
    """One math-verify process: ``state`` is "dead", "starting", "idle" or "busy" (with ``job``)."""

    def __init__(self) -> None:
        self.proc: Any = None  # the context's Process once started (its class depends on the start method)
        self.conn: Any = None  # its end of the Pipe once started
        self.state = "dead"
        self.job: int | None = None
        self.deadline = 0.0

    def start(self, startup_s: float) -> None:
        ctx = _context()
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self.state = "starting"
        self.deadline = time.monotonic() + startup_s

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None
        self.state = "dead"
        self.job = None

    def stop(self) -> None:
        """Ask politely, then kill."""
        if self.conn is not None and self.state == "idle":
            try:
                self.conn.send(None)
                self.proc.join(timeout=1)
            except (OSError, ValueError):
                pass
        self.kill()


class VerifyPool:
    """math-verify in up to ``size`` worker processes with a hard per-answer time limit.

    ``run(jobs)`` returns, per (answer, truth) job, True/False, or None when the check timed out (its
    worker is killed and replaced) or its worker died twice (the answer is retried once on a fresh
    worker first). Workers are started on demand and kept between calls; ``close()`` stops them.
    """

    def __init__(self, size: int, timeout_s: float, startup_s: float = 60.0):
        self.workers = [_Worker() for _ in range(max(1, size))]
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self.timeouts = 0
        self.deaths = 0

    def _revive(self, wanted: int) -> None:
        """Start again each of the first ``wanted`` workers that is dead."""
        for w in self.workers[:wanted]:
            if w.state == "dead" or w.proc is None or not w.proc.is_alive():
                if w.state != "dead":
                    self.deaths += 1  # died while idle (or starting), since the last batch
                w.kill()
                w.start(self.startup_s)

    def run(self, jobs: list[tuple[str, str]]) -> list[bool | None]:
        results: list[bool | None] = [None] * len(jobs)
        queue = collections.deque(range(len(jobs)))
        tries = [0] * len(jobs)
        failed_starts = 0
        self._revive(min(len(self.workers), len(jobs)))

        def restart(w: _Worker) -> None:
            w.kill()
            if queue:
                w.start(self.startup_s)

        while queue or any(w.state in ("busy",) for w in self.workers):
            for w in self.workers:
                if w.state == "idle" and queue:
                    j = queue.popleft()
                    tries[j] += 1
                    try:
                        w.conn.send((jobs[j][0], jobs[j][1], self.timeout_s))
                    except (OSError, ValueError):  # died while idle
                        queue.appendleft(j)
                        tries[j] -= 1
                        self.deaths += 1
                        restart(w)
                        continue
                    w.state, w.job, w.deadline = "busy", j, time.monotonic() + self.timeout_s
            live = [w for w in self.workers if w.state in ("starting", "busy")]
            if not live:
                if not queue:
                    break
                # every worker is dead or idle without work: start one
                w = self.workers[0]
                w.kill()
                w.start(self.startup_s)
                continue
            now = time.monotonic()
            ready = wait([w.conn for w in live], timeout=max(0.0, min(w.deadline for w in live) - now))
            for w in live:
                if w.conn not in ready:
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError) as exc:  # the worker died
                    self.deaths += 1
                    if w.state == "busy":
                        assert w.job is not None  # a busy worker has a job
                        if tries[w.job] < 2:
                            queue.appendleft(w.job)  # retried once on a fresh worker
                        else:
                            results[w.job] = None
                    else:
                        failed_starts += 1
                        if failed_starts > 3 * len(self.workers):
                            raise RuntimeError("reward workers die while starting (is math-verify installed?)") from exc
                    restart(w)
                    continue
                if w.state == "starting":
                    w.state = "idle"
                else:
                    assert w.job is not None  # a busy worker has a job
                    results[w.job] = bool(msg)
                    w.state, w.job = "idle", None
            now = time.monotonic()
            for w in live:
                if w.state in ("starting", "busy") and now >= w.deadline:
                    if w.state == "busy":
                        assert w.job is not None  # a busy worker has a job
                        self.timeouts += 1
                        results[w.job] = None
                    else:
                        failed_starts += 1
                        if failed_starts > 3 * len(self.workers):
                            raise RuntimeError(f"reward workers did not start within {self.startup_s}s")
                    restart(w)
        return results

    def close(self) -> None:
        for w in self.workers:
            w.stop()


# ------------------------------------------------------------------------------------------ the reward

class RewardFn:
    """Scores responses against ground-truth strings.

    kind "binary" gives 1.0/0.0, "pm1" gives +1.0/-1.0. A response without a box is wrong. ``timeouts``
    counts checks that hit the limit, ``worker_deaths`` worker processes that died (both score wrong
    when they cannot be retried). ``workers``: size of the process pool (0: min(4, CPU count)).
    """

    def __init__(self, kind: str = "binary", timeout_s: float = 5.0, sandbox: str = "process", workers: int = 0):
        if kind not in ("binary", "pm1"):
            raise ValueError(f"kind: expected 'binary' or 'pm1', got {kind!r}")
        if sandbox not in ("process", "inline"):
            raise ValueError(f"sandbox: expected 'process' or 'inline', got {sandbox!r}")
        if not timeout_s > 0 or timeout_s == float("inf"):
            raise ValueError(f"timeout_s: must be a finite number > 0, got {timeout_s}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers: must be an integer >= 0 (0 = automatic), got {workers!r}")
        self.kind = kind
        self.timeout_s = timeout_s
        self.sandbox = sandbox
        self.timeouts = 0
        self.worker_deaths = 0
        size = workers or min(4, os.cpu_count() or 1)
        self._pool = VerifyPool(size, timeout_s) if sandbox == "process" else None

    def check_batch(self, responses: list[str], truths: list[str]) -> list[bool]:
        """Correct or not, per (response, truth); undecided answers go to math-verify in parallel."""
        if len(responses) != len(truths):
            raise ValueError(f"check_batch: {len(responses)} responses but {len(truths)} ground truths")
        out: list[bool] = [False] * len(responses)
        pending: list[int] = []
        answers: list[str] = []  # "" where there is none (never checked)
        for i, (resp, truth) in enumerate(zip(responses, truths, strict=True)):
            answer = extract_boxed(resp)
            answers.append(answer or "")
            if not answer or len(answer) > MAX_ANSWER_CHARS:
                continue
            verdict = quick_verdict(answer, str(truth))
            if verdict is None:
                pending.append(i)
            else:
                out[i] = verdict
        if not pending:
            return out
        jobs = [(answers[i], str(truths[i])) for i in pending]
        if self._pool is not None:
            t0, d0 = self._pool.timeouts, self._pool.deaths
            verdicts = self._pool.run(jobs)
            self.worker_deaths += self._pool.deaths - d0
            timed_out = self._pool.timeouts - t0
        else:
            verdicts = []
            for answer, truth in jobs:
                try:
                    verdicts.append(_math_verify(answer, truth, self.timeout_s))
                except Exception:  # noqa: BLE001 - math-verify's own time limit or a parse failure
                    verdicts.append(None)
            timed_out = sum(v is None for v in verdicts)
        self.timeouts += timed_out
        for i, v in zip(pending, verdicts, strict=True):
            if v is None:
                warnings.warn(f"reward check timed out after {self.timeout_s}s (or its worker died) on answer "
                              f"{answers[i][:80]!r}", stacklevel=3)
            out[i] = bool(v)
        return out

    def is_correct(self, response: str, truth: str) -> bool:
        return self.check_batch([response], [truth])[0]

    def final_answer(self, response: str) -> str | None:
        """The answer a response gives (its last \\boxed{}), for the diversity metrics."""
        return extract_boxed(response)

    def _score(self, ok: bool) -> float:
        if self.kind == "binary":
            return 1.0 if ok else 0.0
        return 1.0 if ok else -1.0

    def __call__(self, response: str, truth: str) -> float:
        return self._score(self.is_correct(response, truth))

    _own_call = __call__  # batch() falls back to per-item calls when __call__ is replaced

    def batch(self, responses: list[str], truths: list[str]) -> list[float]:
        """Rewards of a batch (the pool checks undecided answers in parallel). A subclass (or a test)
        that overrides ``__call__`` is honoured: its ``__call__`` is then applied per response."""
        if type(self).__call__ is not RewardFn._own_call:
            return [float(self(r, t)) for r, t in zip(responses, truths, strict=True)]
        return [self._score(ok) for ok in self.check_batch(responses, truths)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort: __del__ must not raise during interpreter shutdown
            pass
