"""Run an untrusted program (a policy's code answer) in a sandboxed process.

    box = Sandbox(SandboxLimits(cpu_s=2, wall_s=5, memory_mb=256))
    res = box.run_python("print(int(input()) * 2)", stdin="21\\n")
    res.status, res.stdout          # ("ok", "42\\n")

What confines the program (each piece is tested with a hostile program in tests/trainer/rewards/test_sandbox.py):

* a separate process, started through ``_sandbox_launcher.py`` (standard library only), whose process
  group is SIGKILLed when ``wall_s`` runs out;
* memory: a memory cgroup per call where the trainer can make one (``_sandbox_cgroup.py``; root on cgroup v1,
  or a delegated v2 cgroup), which counts everything the program and its forks hold against ``memory_mb``; else
  ``memory_mb`` of address space per process (RLIMIT_AS). Memory outside both is refused: memfd_create,
  SysV shared memory and message queues (the seccomp filter), POSIX message queues (RLIMIT_MSGQUEUE 0);
* disk: the work dir is a private tmpfs of ``disk_mb`` in the program's own mount namespace, its only
  writable place, shared by its forks: the call's total write quota, held in memory and gone with the call;
  RLIMIT_FSIZE caps each file at ``file_size_mb``;
* resource limits: CPU seconds (RLIMIT_CPU: SIGXCPU), open files, process count (RLIMIT_NPROC), no core dumps;
* an empty network namespace (only a loopback device, down), a pid namespace whose init takes every
  leftover process with it, a mount and an IPC namespace; created directly as root, inside a user namespace
  otherwise. When the OS refuses namespaces the program runs without them and a one-time warning says so;
* a seccomp filter (x86_64, aarch64): no socket but AF_INET/AF_INET6 (which the network namespace confines),
  so no unix socket reaches a listener by its path (nor AF_VSOCK the host of a VM), no datagram socketpair
  (it could be re-connected to a path), no io_uring (it opens sockets without a system call the filter sees),
  and the memory calls above. Landlock's scoping (ABI 6) covers only abstract unix sockets and no Landlock
  ABI covers sockets by path, so the filter is what closes them, on any kernel with seccomp (Linux >= 3.5);
* Landlock (Linux ≥ 5.13): reads and execution only of the interpreter's own files, the shared libraries
  and the program's temporary directory (not the project, the run's data, /tmp or /etc: a code answer
  cannot read its tests' expected outputs); writes only inside that directory; TCP bind/connect denied
  (Landlock ABI ≥ 4, a second network barrier); no signals to, and no /proc/<pid>/environ of, processes
  outside the sandbox; a one-time warning when the kernel has no Landlock;
* when the trainer runs as root, the program runs as ``nobody`` (RLIMIT_NPROC does not bind root),
  with an interpreter that user can execute (``/usr/bin/python3`` when the trainer's is under /root);
* a scrubbed environment (PATH, LANG, HOME/TMPDIR = the work dir; nothing of the parent's), Python's
  isolated mode (-I), stdin from the caller, stdout/stderr read with a byte cap (``max_output_bytes``:
  a program that prints without end is killed with status ``output_limit``);
* a fresh temporary working directory, removed afterwards (whatever the program left in it).

Statuses come from the sandbox's own account, never from what the program printed: ``ok`` (exit 0, whatever
it wrote to stderr), ``timeout`` (the wall clock), ``output_limit`` (the stdout cap), ``cpu_limit`` (SIGXCPU, or
the hard limit's SIGKILL after the CPU time ran out), ``memory_limit`` (the kernel killed a process of the
program's cgroup for its limit), ``disk_limit`` (the tmpfs had no space or inode left at the end),
``file_size_limit`` (a file of the work dir reached ``file_size_mb``), ``error`` (any other non-zero exit or
signal), ``sandbox_error`` (the launcher reported that the isolation could not be set up; the program did not run).

Remote backend: ``SandboxFusionClient(url)`` posts the same program to a SandboxFusion server (the
``/run_code`` API verl uses: ``reward.sandbox_fusion_url``) instead of running it here.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastcov.trainer.rewards import _sandbox_launcher as launcher
from fastcov.trainer.rewards._sandbox_cgroup import MemoryCgroup, usable_cgroup

LAUNCHER = Path(launcher.__file__)
NOBODY = 65534

_warned: set[str] = set()
_caps_lock = threading.Lock()
_caps: dict | None = None


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


@dataclass
class SandboxLimits:
    cpu_s: float = 2.0  # CPU seconds (rounded up to whole seconds)
    wall_s: float = 6.0  # wall clock, then SIGKILL
    memory_mb: int = 256  # the program's cgroup (all its processes) where one can be made, else RLIMIT_AS
    file_size_mb: float = 8.0  # RLIMIT_FSIZE: largest file the program may write
    disk_mb: float = 32.0  # its work dir's tmpfs: all it may hold on disk at once, forks included
    nproc: int = 8  # RLIMIT_NPROC (processes of the program's user in its namespace)
    nofile: int = 64  # open files
    max_output_bytes: int = 1 << 20  # stdout cap; stderr keeps its first 64 KiB


@dataclass
class SandboxResult:
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    workdir: str = ""  # where it ran (already removed)
    isolation: dict = field(default_factory=dict)
    # the sandbox's account: exit / signal / cpu_s (init's wait), disk_full / file_size_hit / disk_bytes (the
    # tmpfs at the end), oom_kills / memory_peak_bytes (the cgroup), setup_error
    account: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ------------------------------------------------------------------------------------------ capabilities

def _others_can_exec(path: str) -> bool:
    """Whether a user other than the owner (and outside its group) can run ``path``: x for others on the
    file and on every directory above it."""
    p = Path(os.path.realpath(path))
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def _python_for(drop_uid: bool) -> str | None:
    """An interpreter the program's user can execute."""
    candidates = [os.path.realpath(sys.executable)]
    if drop_uid:
        candidates += ["/usr/bin/python3", shutil.which("python3") or ""]
        return next((c for c in candidates if c and _others_can_exec(c)), None)
    return candidates[0]


# Beside the interpreter's own tree (its prefix's lib/), what any dynamically linked program reads to start.
SYSTEM_READS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache", "/dev/urandom")


def read_paths(python: str) -> list[str]:
    """What a program needs to read: the interpreter, its prefix's lib/ (stdlib, libpython) and the shared
    libraries. Not the project, other runs, the run's data, /tmp or /etc."""
    exe = os.path.realpath(python)
    prefix = os.path.dirname(os.path.dirname(exe))
    return [exe, os.path.join(prefix, "lib"), *SYSTEM_READS]


def _landlock_abi() -> int:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        v = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
        return max(0, int(v))
    except (OSError, AttributeError):
        return 0


# What the probe gives up, in this order, when a trivial program does not start; and the warning that says so.
_FALLBACKS = (
    ("cgroup", "sandbox: a memory cgroup was made but a program does not start in it ({why}); each process is held "
               "to memory_mb of address space instead"),
    ("restrict_reads", "sandbox: Python does not start with reads limited to its own files ({why}); programs can "
                       "read every file their user can (the run's data included)"),
    ("seccomp", "sandbox: the seccomp filter is refused ({why}); programs can reach unix sockets by their path and "
                "hold memfd / SysV shared memory outside the memory limit"),
    ("namespaces", "sandbox: this OS refuses new network/pid/mount namespaces ({why}); programs run WITHOUT network "
                   "isolation{tcp}, WITHOUT a total write quota (only file_size_mb per file) and forks are reaped "
                   "by process group only"),
)


def capabilities() -> dict:
    """What isolation this machine allows (probed once per process by running a trivial program).

    Keys: namespaces (network, pid, mount and IPC namespaces, the work dir's tmpfs), landlock (Landlock ABI,
    0 = none), seccomp (the filter exists for this architecture), cgroup ((version, parent folder) of the memory
    cgroups, or None), drop_uid (running as root: the program runs as nobody), python (its interpreter),
    nproc_enforced (RLIMIT_NPROC binds the program's user). Warns once for each missing barrier.
    """
    global _caps
    with _caps_lock:
        if _caps is not None:
            return _caps
        root = os.geteuid() == 0
        python = _python_for(drop_uid=root)
        drop = root and python is not None
        if root and python is None:
            python = os.path.realpath(sys.executable)
            _warn_once("uid", "sandbox: running as root and no Python interpreter is executable by 'nobody'; "
                              "programs run as root, where RLIMIT_NPROC (the fork limit) does not apply")
        abi = _landlock_abi()
        caps: dict[str, Any] = {"landlock": abi, "drop_uid": drop, "python": python, "namespaces": True,
                                "restrict_reads": abi > 0, "seccomp": os.uname().machine in launcher.SECCOMP_ARCHES,
                                "cgroup": usable_cgroup() if root else None}
        _caps = caps  # _spawn reads it
        probe_limits = SandboxLimits(cpu_s=5, wall_s=30)
        probe = _run(["-c", "import json, re, math; print('ok')"], "", probe_limits, caps)
        for key, msg in _FALLBACKS:
            if probe.status == "ok":
                break
            if not caps[key]:
                continue
            caps[key] = None if key == "cgroup" else False
            why = (probe.account.get("setup_error") or probe.stderr.strip() or probe.status)[:200]
            probe = _run(["-c", "print('ok')"], "", probe_limits, caps)
            tcp = " (Landlock still denies TCP)" if caps["landlock"] >= 4 else ""
            _warn_once(key, msg.format(why=why, tcp=tcp))
        if probe.status != "ok":
            _caps = None
            raise RuntimeError(f"sandbox: cannot start a sandboxed Python at all: {probe.stderr.strip()[:500]}")
        if not caps["landlock"]:
            _warn_once("landlock", "sandbox: the kernel has no Landlock; reads (the run's data included), writes "
                                   "outside the work dir and other processes' /proc entries are limited only by "
                                   "file permissions")
        if os.uname().machine not in launcher.SECCOMP_ARCHES:
            _warn_once("seccomp", f"sandbox: no seccomp filter for {os.uname().machine}; programs can reach unix "
                                  "sockets by their path and hold memfd / SysV shared memory outside the memory limit")
        caps["nproc_enforced"] = (not root) or drop
        return caps


# ------------------------------------------------------------------------------------------ running

def _scrubbed_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir,
            "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}


def _run(args: list[str], stdin: str, limits: SandboxLimits, caps: dict,
         files: dict[str, str] | None = None) -> SandboxResult:
    """Run ``python -I <args>`` in a fresh work dir holding ``files``; the work dir is removed afterwards."""
    workdir = tempfile.mkdtemp(prefix="fastcov-sbx-")
    cgroup = None
    try:
        os.chmod(workdir, 0o700)
        for name, text in (files or {}).items():
            Path(workdir, name).write_text(text, encoding="utf-8")
        if caps["drop_uid"]:
            for p in [workdir] + [str(Path(workdir, n)) for n in (files or {})]:
                os.chown(p, NOBODY, NOBODY)
        memory = int(limits.memory_mb * 2**20)
        if caps.get("cgroup"):
            try:
                cgroup = MemoryCgroup.create(caps["cgroup"][0], caps["cgroup"][1], memory)
            except OSError as exc:
                res = SandboxResult("sandbox_error", None, "", f"fastcov-sandbox: cannot make a cgroup: {exc}", 0.0)
                res.account = {"setup_error": f"cannot make a cgroup: {exc}"}
                return res
        spec = {
            "argv": [caps["python"], "-I", *args], "workdir": workdir,
            "cpu_s": limits.cpu_s, "memory_bytes": memory,
            # with a cgroup counting the memory, the address space is only a backstop against absurd reservations
            "as_bytes": max(4 * memory, memory + (1 << 30)) if cgroup else memory,
            "cgroup_procs": cgroup.procs if cgroup else None,
            "fsize_bytes": int(limits.file_size_mb * 2**20), "disk_bytes": int(limits.disk_mb * 2**20),
            "nofile": limits.nofile, "nproc": limits.nproc,
            "netns": caps["namespaces"], "pidns": caps["namespaces"], "mountns": caps["namespaces"],
            "landlock": caps["landlock"] > 0, "seccomp": bool(caps["seccomp"]),
            "read_paths": read_paths(caps["python"]) if caps.get("restrict_reads") else None,
            "uid": NOBODY if caps["drop_uid"] else None, "gid": NOBODY if caps["drop_uid"] else None,
        }
        res = _spawn(spec, stdin, limits)
        if cgroup is not None:
            res.account["oom_kills"] = cgroup.oom_kills()
            res.account["memory_peak_bytes"] = cgroup.peak_bytes()
        if "file_size_hit" not in res.account:  # no private tmpfs: what it wrote is here, in the work dir
            res.account["file_size_hit"] = launcher.disk_account(workdir, spec["fsize_bytes"])["file_size_hit"]
        res.status = _status(res, limits)
        res.workdir = workdir
        res.isolation = {"namespaces": caps["namespaces"], "landlock": caps["landlock"], "seccomp": caps["seccomp"],
                         "cgroup": caps["cgroup"][0] if caps.get("cgroup") else None,
                         "uid": "nobody" if caps["drop_uid"] else os.geteuid()}
        return res
    finally:
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)


def _spawn(spec: dict, stdin: str, limits: SandboxLimits) -> SandboxResult:
    """Run the launcher; the result's status is left for ``_status`` (the caller adds the cgroup's account)."""
    launcher_python = os.path.realpath(sys.executable)
    t0 = time.monotonic()
    report_r, report_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [launcher_python, "-I", "-S", str(LAUNCHER), json.dumps({**spec, "report_fd": report_w})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=spec["workdir"],
            env=_scrubbed_env(spec["workdir"]), start_new_session=True, close_fds=True, pass_fds=(report_w,),
        )
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)
    try:
        return _collect(proc, stdin, limits, t0, report_r)
    finally:
        os.close(report_r)


def _collect(proc: subprocess.Popen, stdin: str, limits: SandboxLimits, t0: float, report_r: int) -> SandboxResult:
    """The program's capped stdout/stderr, its exit, and the launcher's account (read from ``report_r``, which
    holds every line once the launcher has exited: init writes before it exits, the launcher after it waited)."""
    stdin_pipe, stdout_pipe, stderr_pipe = proc.stdin, proc.stdout, proc.stderr
    assert stdin_pipe is not None and stdout_pipe is not None and stderr_pipe is not None  # all three are PIPE

    def feed():
        try:
            stdin_pipe.write(stdin.encode("utf-8"))
        except (BrokenPipeError, OSError):
            pass  # the program closed stdin or exited
        finally:
            try:
                stdin_pipe.close()
            except OSError:
                pass

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    out, err = bytearray(), bytearray()
    err_cap = 64 * 1024
    over = timed_out = False
    deadline = t0 + limits.wall_s
    sel = selectors.DefaultSelector()
    sel.register(stdout_pipe, selectors.EVENT_READ, "out")
    sel.register(stderr_pipe, selectors.EVENT_READ, "err")
    open_streams = 2
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data == "out":
                out += chunk
                if len(out) > limits.max_output_bytes:
                    over = True
            elif len(err) < err_cap:
                err += chunk[: err_cap - len(err)]
        if over:
            break
    # both streams closed (or a limit hit): wait for the exit within what is left of the wall clock
    if not (timed_out or over):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out or over:
        _kill_group(proc)
    proc.wait()
    sel.close()
    for stream in (stdout_pipe, stderr_pipe):
        stream.close()
    feeder.join(timeout=1.0)
    wall = time.monotonic() - t0
    rc = proc.returncode
    stdout = bytes(out[: limits.max_output_bytes]).decode("utf-8", "replace")
    stderr = bytes(err).decode("utf-8", "replace")
    account = _read_account(report_r)
    account.update(timed_out=timed_out, output_over=over)
    return SandboxResult("", rc, stdout, stderr, wall, account=account)


def _read_account(fd: int) -> dict:
    os.set_blocking(fd, False)
    raw = b""
    while len(raw) < 1 << 20:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        raw += chunk
    account: dict = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        if isinstance(fields, dict):
            account.update(fields)
    return account


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _status(res: SandboxResult, limits: SandboxLimits) -> str:
    """The run's status from the sandbox's account alone (module docstring); the program's output never counts."""
    acc = res.account
    if acc.get("output_over"):
        return "output_limit"
    if acc.get("timed_out"):
        return "timeout"
    if acc.get("setup_error"):
        return "sandbox_error"
    if "signal" in acc:  # init's wait for the program
        code, sig = acc.get("exit"), acc.get("signal")
    else:  # no pid namespace: the launcher became the program, its wait status is the program's own
        rc = res.returncode
        code, sig = (None, -rc) if rc is not None and rc < 0 else (rc, None)
    if sig is None and code == 0:
        return "ok"
    if acc.get("oom_kills"):
        return "memory_limit"
    cpu_used = acc.get("cpu_s")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used is not None  # the hard limit, a second on
                                 and cpu_used >= max(1, int(limits.cpu_s + 0.999))):
        return "cpu_limit"
    if acc.get("disk_full"):
        return "disk_limit"
    if sig == signal.SIGXFSZ or acc.get("file_size_hit"):
        return "file_size_limit"
    return "error"


class Sandbox:
    """Runs Python programs under ``limits`` with whatever isolation ``capabilities()`` found."""

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()
        self.caps = capabilities()

    def run_python(self, code: str, stdin: str = "") -> SandboxResult:
        return _run(["main.py"], stdin, self.limits, self.caps, files={"main.py": code})


class SandboxFusionClient:
    """A SandboxFusion server's ``/run_code`` API (what verl calls ``sandbox_fusion.url``).

    ``url``: the full endpoint, e.g. ``http://host:8080/run_code``. Returns a ``SandboxResult`` with the
    statuses above (``sandbox_error`` when the server cannot be reached or reports its own error).
    """

    def __init__(self, url: str, limits: SandboxLimits | None = None, request_timeout_s: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox_fusion_url must start with http:// or https://, got {url!r}")
        self.url = url
        self.limits = limits or SandboxLimits()
        self.request_timeout_s = request_timeout_s

    def request_body(self, code: str, stdin: str) -> dict:
        return {"code": code, "stdin": stdin, "language": "python", "compile_timeout": 10,
                "run_timeout": self.limits.wall_s, "memory_limit_MB": int(self.limits.memory_mb)}

    def run_python(self, code: str, stdin: str = "") -> SandboxResult:
        import urllib.error
        import urllib.request

        t0 = time.monotonic()
        req = urllib.request.Request(self.url, data=json.dumps(self.request_body(code, stdin)).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                body = json.loads(resp.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return SandboxResult("sandbox_error", None, "", f"SandboxFusion request failed: {exc}",
                                 time.monotonic() - t0)
        return self.parse_response(body, time.monotonic() - t0)

    @staticmethod
    def parse_response(body: dict, wall: float = 0.0) -> SandboxResult:
        run = body.get("run_result") or {}
        out, err = run.get("stdout") or "", run.get("stderr") or ""
        rc = run.get("return_code")
        api, run_status = body.get("status"), run.get("status")
        if api == "SandboxError":
            status = "sandbox_error"
        elif run_status == "TimeLimitExceeded":
            status = "timeout"
        elif api == "Success" and rc == 0:
            status = "ok"
        else:  # the server's own status fields only, never the program's stderr
            status = "error"
        return SandboxResult(status, rc, out, err, wall, isolation={"remote": True})
