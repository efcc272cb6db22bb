"""Verifiable rewards: the last \\boxed{} answer of a response, checked against the ground truth.

    fn = RewardFn(kind="binary", timeout_s=5.0)
    fn("... so \\boxed{\\frac{1}{2}}", "0.5")   # -> 1.0

Checking is two-stage: a normalised string comparison (instant, covers most answers), then math-verify
for mathematical equivalence. math-verify runs either inline with its own signal-based limit or, by
default, in a worker process that is killed when a check exceeds ``timeout_s`` (a pathological answer
such as ``10^{10^{10}}`` can block inside C code where signals never fire).
"""

from __future__ import annotations

import multiprocessing as mp
import re
import warnings

_BOX_RE = re.compile(r"\\(?:boxed|fbox)")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``.

    Braces nest: ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. An unclosed box is ignored.
    Returns None when there is no complete box.
    """
    last = None
    for m in _BOX_RE.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                c = text[j]
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        last = text[i + 1 : j].strip()
                        break
                j += 1
        elif i < len(text) and text[i] == " ":
            # "\boxed 5": the argument runs to the next whitespace or "$".
            rest = text[i:].lstrip(" ")
            arg = re.match(r"[^\s$]+", rest)
            if arg:
                last = arg.group(0).rstrip(".,")
    return last


def _normalise(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d+(\.\d+)?", s):
        try:
            f = float(s)
            s = str(int(f)) if f == int(f) else repr(f)
        except (ValueError, OverflowError):
            pass
    return s


def _math_verify(answer: str, truth: str, timeout_s: float | None) -> bool:
    from math_verify import parse, verify

    t = None if timeout_s is None else max(1, int(round(timeout_s)))
    kw = {} if t is None else {"parsing_timeout": t}
    gold = parse(f"${truth}$", **kw) if "\\boxed" not in truth else parse(truth, **kw)
    pred = parse(f"${answer}$", **kw)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=t))


def _worker(conn) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
        except Exception:
            ok = False
        conn.send(ok)


class _VerifyProcess:
    """One long-lived math-verify worker; killed and restarted when a check times out."""

    def __init__(self) -> None:
        self.proc = None
        self.conn = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def check(self, answer: str, truth: str, timeout_s: float, startup_s: float = 60.0) -> bool | None:
        """True/False, or None when the check ran past ``timeout_s`` (the worker is then killed)."""
        fresh = self.proc is None or not self.proc.is_alive()
        if fresh:
            self._start()
        self.conn.send((answer, truth, timeout_s))
        # The first check also pays for spawning the worker and importing sympy.
        if self.conn.poll(timeout_s + (startup_s if fresh else 0.0)):
            try:
                return bool(self.conn.recv())
            except EOFError:
                self.close()
                return None
        self.close()
        return None

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None


class RewardFn:
    """Scores a response string against a ground-truth string.

    kind "binary" gives 1.0/0.0, "pm1" gives +1.0/-1.0. A response without a box is wrong.
    ``timeouts`` counts checks that hit the limit (scored wrong).
    """

    def __init__(self, kind: str = "binary", timeout_s: float = 5.0, sandbox: str = "process"):
        if kind not in ("binary", "pm1"):
            raise ValueError(f"kind: expected 'binary' or 'pm1', got {kind!r}")
        if sandbox not in ("process", "inline"):
            raise ValueError(f"sandbox: expected 'process' or 'inline', got {sandbox!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.kind = kind
        self.timeout_s = timeout_s
        self.sandbox = sandbox
        self.timeouts = 0
        self._proc = _VerifyProcess() if sandbox == "process" else None

    def is_correct(self, response: str, truth: str) -> bool:
        answer = extract_boxed(response)
        if answer is None or answer == "":
            return False
        truth = str(truth)
        if _normalise(answer) == _normalise(truth):
            return True
        if self._proc is not None:
            ok = self._proc.check(answer, truth, self.timeout_s)
        else:
            try:
                ok = _math_verify(answer, truth, self.timeout_s)
            except Exception:
                ok = None
        if ok is None:
            self.timeouts += 1
            warnings.warn(f"reward check timed out after {self.timeout_s}s on answer {answer[:80]!r}",
                          stacklevel=2)
            return False
        return ok

    def __call__(self, response: str, truth: str) -> float:
        ok = self.is_correct(response, truth)
        if self.kind == "binary":
            return 1.0 if ok else 0.0
        return 1.0 if ok else -1.0

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order
        try:
            self.close()
        except Exception:
            pass
