"""The suite's machinery: subprocesses bounded by the part's cap and the run's budget (``Proc``,
``run_cmd``), one invocation's state and its rows (``Suite``), and the environment record."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import _measure as M
from bench._common import is_oom, read_result, short
from bench._common import log as _log
from bench.gpu_suite.presets import COMMIT_ENV, GIB, PACKAGES, PART_CAPS, REPO, SIZE_ALIASES
from bench.gpu_worker import RESULT_MARK


def log(msg: str) -> None:
    _log(msg, "[gpu_suite] ")


# =========================================================================== subprocesses


@dataclass
class Proc:
    """A finished (or stopped) subprocess: exit status, output, wall time."""

    rc: int | None
    out: str
    err: str
    wall_s: float
    timed_out: bool = False

    def tail(self, lines: int = 12) -> str:
        text = [ln for ln in (self.err + "\n" + self.out).splitlines() if ln.strip() and RESULT_MARK not in ln]
        return "\n".join(text[-lines:])

    def result(self) -> dict | None:
        """The worker's result: its last RESULT_MARK line (bench/gpu_worker.py)."""
        return read_result(self.out, RESULT_MARK)

    def last_json(self) -> dict | None:
        """The last stdout line that is a JSON object (bench/vllm_smoke.py's result)."""
        for line in reversed(self.out.splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        return None


def run_cmd(cmd: list[str], timeout: float, env: dict | None = None) -> Proc:
    """Run ``cmd`` in the repository root in its own process group; past ``timeout`` the whole group is
    killed (a benchmark's own case processes too) and what it printed so far is kept."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    t0 = time.perf_counter()
    if timeout <= 0:
        return Proc(None, "", "not started: the suite's --budget is spent", 0.0, timed_out=True)
    p = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         **group)
    try:
        out, err = p.communicate(timeout=timeout)
        return Proc(p.returncode, out, err, time.perf_counter() - t0)
    except subprocess.TimeoutExpired:
        # SIGTERM first: a worker's `finally` blocks run (torch's JIT-build lock, which DeepSpeed takes to build
        # its ops, is released; a SIGKILL mid-build leaves a lock every later run waits on); then SIGKILL
        out, err = _stop_group(p, grace=TERM_GRACE_S)
        return Proc(p.returncode, out or "", (err or "") + f"\nstopped after {timeout:.0f} s",
                    time.perf_counter() - t0, timed_out=True)


TERM_GRACE_S = 5.0


def _stop_group(p: subprocess.Popen, grace: float) -> tuple[str, str]:
    """SIGTERM to ``p``'s process group, SIGKILL after ``grace`` seconds; what it printed."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return p.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "", ""


# =========================================================================== the run


@dataclass
class Suite:
    """One invocation: where its rows go, its size, its time budget, and the rows it recorded."""

    out: Path
    size: str  # full | smoke | rehearse
    steps: int
    timeout: float  # per subprocess
    deadline: float | None  # time.monotonic() by which everything must be done
    gpu: str | None
    slug: str
    date: str
    run_id: str
    rows: list[dict] = field(default_factory=list)
    flat: bool = False  # rows in <out>/run.jsonl, kernel cases in <out>/kernels.jsonl (gpu_run.sh: what comes back)
    caps: dict[str, float] = field(default_factory=dict)  # seconds per part (PART_CAPS, --cap)
    reserve: float = 15.0  # seconds of the budget kept for the summary
    part: str | None = None  # the part running now
    part_deadline: float | None = None  # time.monotonic() by which the running part must end
    faults: dict[str, str] = field(default_factory=dict)  # rehearsal only: part -> "crash" | "hang"

    @property
    def dir(self) -> Path:
        return self.out if self.flat else self.out / self.slug

    @property
    def path(self) -> Path:
        return self.out / "run.jsonl" if self.flat else self.dir / f"suite-{self.date}.jsonl"

    @property
    def scratch(self) -> Path:
        """Where the tools' own reports go: outside <out> when flat (the device call returns 8 files)."""
        if not self.flat:
            return self.dir
        path = Path(tempfile.gettempdir()) / f"gpu-suite-{self.run_id}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def part_left(self) -> float:
        """Seconds the running part may still take: its cap, and the budget less the summary's reserve."""
        cap = float("inf") if self.part_deadline is None else self.part_deadline - time.monotonic()
        return min(cap, self.left() - self.reserve)

    def record(self, part: str, name: str, status: str, reason: str = "", summary: str = "", **fields) -> dict:
        row = {"run": self.run_id, "part": part, "name": name, "status": status, "reason": reason,
               "summary": summary, "size": self.size, "gpu": self.gpu,
               "at": _dt.datetime.now().isoformat(timespec="seconds"), **fields}
        M.append_jsonl(self.path, row, default=str)
        self.rows.append(row)
        log(f"{part} / {name}: {status} {summary or reason}".rstrip())
        return row

    def run(self, cmd: list[str], env: dict | None = None) -> Proc:
        """A subprocess bounded by --timeout, the running part's cap and what is left of --budget (less the
        summary's reserve). Under an injected ``hang`` fault (the rehearsal) the command is a stand-in that
        writes one row and then sleeps until it is stopped."""
        if self.faults.get(self.part or "") == "hang":
            row = json.dumps({"run": self.run_id, "part": self.part, "name": "hang (injected)", "status": "partial",
                              "reason": "", "summary": "written before the injected hang", "size": self.size,
                              "gpu": self.gpu})
            cmd = [sys.executable, "-c", "import os, sys, time\nwith open(sys.argv[1], 'a') as f:\n"
                   "    f.write(sys.argv[2] + '\\n'); f.flush(); os.fsync(f.fileno())\ntime.sleep(3600)",
                   str(self.path), row]
        return run_cmd(cmd, min(self.timeout, self.part_left()), env)


def make_suite(args) -> Suite:
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    out = Path(args.out)
    out = out if out.is_absolute() else Path.cwd() / out
    now = _dt.datetime.now()
    size = SIZE_ALIASES[args.size]
    caps = {**PART_CAPS[size], **dict(args.cap or [])}
    return Suite(out=out, size=size, steps=args.steps, timeout=args.timeout,
                 deadline=time.monotonic() + args.budget if args.budget > 0 else None, gpu=gpu,
                 slug=M.slugify(gpu) if gpu else "cpu", date=now.date().isoformat(),
                 run_id=f"{now:%Y%m%dT%H%M%S.%f}-{os.getpid()}", flat=args.flat, caps=caps,
                 reserve=8.0 if size == "rehearse" else 15.0, faults=dict(args.fault or []))


def guarded(s: Suite, part: str, name: str, fn) -> None:
    """``fn(s)``; whatever it raises becomes an error (or OOM) row named ``name``, with its message, and the run
    goes on."""
    try:
        fn(s)
    except Exception as exc:  # noqa: BLE001
        s.record(part, name, "OOM" if is_oom(exc) else "error", short(exc), traceback=traceback.format_exc(limit=8))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except SystemExit as exc:  # correctness_gpu.die(): its message, not only the status
        message = getattr(exc, "message", None)
        s.record(part, name, "error", f"exited {exc.code}" + (f": {message}" if message else ""))



# =========================================================================== environment


def package_version(module: str, dist: str) -> str | None:
    """The installed version of ``dist`` if ``module`` can be found (nothing is imported), else None."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
        return importlib.metadata.version(dist)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - no NVML: the driver stays unknown
        return None


def git_commit() -> str | None:
    """HEAD of the checkout; where the tree travelled without .git, $FASTCOV_COMMIT (the device call sets it)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == REPO.resolve():
            return lines[1]  # not a repository above the tree
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get(COMMIT_ENV, "").strip() or None


def environment(s: Suite, argv: list[str]) -> dict:
    """The environment record's fields: GPU, driver, CUDA, Python, package versions, command, commit."""
    props = torch.cuda.get_device_properties(0) if s.gpu else None
    versions = {"torch": torch.__version__, **{dist: package_version(mod, dist) for mod, dist in PACKAGES}}
    return {"gpu_name": s.gpu, "gpu_memory_gib": props.total_memory / GIB if props else None,
            "capability": f"{props.major}.{props.minor}" if props else None,
            "driver": driver_version() if s.gpu else None, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": platform.node(), "versions": versions,
            "command": "python -m bench.gpu_suite " + " ".join(argv), "commit": git_commit(), "jsonl": str(s.path)}


def env_summary(env: dict) -> str:
    v = env["versions"]
    head = (f"{env['gpu_name']} ({env['gpu_memory_gib']:.0f} GiB, sm {env['capability']}), driver {env['driver']}, "
            f"CUDA {env['cuda']}" if env["gpu_name"] else "CPU (no CUDA)")
    return head + "; " + ", ".join(f"{k} {v[k] or '—'}" for k in v)
