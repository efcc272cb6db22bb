"""Two hosts on one machine (``make test-multinode``): two network namespaces joined by a veth pair, each
host's processes in their own UTS namespace with their own host name, launched with torchrun.

    host a: namespace <prefix>a, interface <prefix>a, 10.231.0.1/24, host name <prefix>-a
    host b: namespace <prefix>b, interface <prefix>b, 10.231.0.2/24, host name <prefix>-b

The addresses exist only inside the two namespaces, so every packet of a test stays between them (and
127.0.0.1 inside each). The prefix is ``fcvmn`` + this pytest's pid: the ``two_hosts`` fixture's
finaliser kills every process it started and every process left in its namespaces, then deletes the
namespaces (the veth pair goes with them), pass or fail. Namespaces another pytest left behind (its
pid is gone) are removed before new ones are made.

Collected only when ``FASTCOV_MULTINODE=1`` (make test-multinode sets it); it needs root (CI runs as
root) and fails, rather than skips, without it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "fcvmn"
SUBNET = "10.231.0"
MASTER_PORT = 29500
CMD_TIMEOUT = 30  # seconds for one ip/unshare command


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT, check=check)


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process inside ``ns`` (all started by this harness), then delete it."""
    for _ in range(3):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    _ip("netns", "del", ns, check=False)


def _remove_stale() -> None:
    """Namespaces of an earlier harness run whose pytest is gone (killed before its finaliser ran)."""
    for ns in _namespaces():
        m = re.fullmatch(PREFIX + r"(\d+)[ab]", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_namespace(ns)


@dataclass
class Host:
    ns: str  # network namespace, and the name of its end of the veth pair
    hostname: str
    address: str

    @property
    def ifname(self) -> str:
        return self.ns


@dataclass
class Launch:
    """One torchrun on one host: its process, console log and torchrun's per-rank log directory."""

    host: Host
    proc: subprocess.Popen
    console: Path
    log_dir: Path

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"host {self.host.hostname}: still running after {timeout:.0f} s\n{self.tail()}",
                        pytrace=False)

    def rank_log(self, stream: str) -> str:
        """What this host's (only) rank wrote to ``stream`` ('stdout' or 'stderr'), torchrun's --redirects."""
        files = sorted(self.log_dir.rglob(f"{stream}.log"))
        return "".join(f.read_text(errors="replace") for f in files)

    def tail(self, n: int = 4000) -> str:
        """The console's end, then each rank's stderr end, without the deprecation warnings that would
        otherwise fill it (a rank that dies names its error last, after hundreds of them)."""
        text = self.console.read_text(errors="replace") if self.console.exists() else ""
        parts = [f"--- {self.host.hostname} console ---\n{text[-n:]}"]
        for f in sorted(self.log_dir.rglob("stderr.log")):
            lines = f.read_text(errors="replace").splitlines()
            kept = "\n".join(ln for i, ln in enumerate(lines) if not _is_warning_noise(lines, i))
            parts.append(f"--- {f.relative_to(self.log_dir)} ---\n{kept[-n:]}")
        return "\n".join(parts)


def _is_warning_noise(lines: list[str], i: int) -> bool:
    """A FutureWarning/DeprecationWarning line, or the source line Python prints under one."""
    if "FutureWarning" in lines[i] or "DeprecationWarning" in lines[i]:
        return True
    return i > 0 and ("FutureWarning" in lines[i - 1] or "DeprecationWarning" in lines[i - 1]) \
        and lines[i].startswith("  ")


@dataclass
class TwoHosts:
    a: Host
    b: Host
    workdir: Path
    launches: list[Launch] = field(default_factory=list)

    def launch(self, host: Host, args: list[str], nnodes: int = 2, nproc: int = 1, port: int = MASTER_PORT,
               tag: str = "") -> Launch:
        """``torchrun --nnodes {nnodes} --nproc_per_node {nproc} --master_addr <a's address> -m fastcov.cli
        train configs/tiny.yaml trainer.zero_stage=3 ARGS`` on ``host``, in its own UTS namespace with its
        host name. Each rank's output goes to files under the launch's log directory."""
        node_rank = 0 if host is self.a else 1
        name = f"{host.hostname}{tag}-{len(self.launches)}"
        log_dir, console = self.workdir / f"{name}.logs", self.workdir / f"{name}.console"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                    "--nproc_per_node", str(nproc), "--node_rank", str(node_rank),
                    "--master_addr", self.a.address, "--master_port", str(port),
                    "--log-dir", str(log_dir), "--redirects", "3",
                    "-m", "fastcov.cli", "train", "configs/tiny.yaml", "trainer.zero_stage=3", *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTCOV_NODE", "MASTER_", "RANK",
                                                                         "WORLD_SIZE", "LOCAL_"))}
        env.update(GLOO_SOCKET_IFNAME=host.ifname, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONFAULTHANDLER="1")  # a rank that aborts prints where its threads were
        return self.spawn(host, torchrun, env, console, log_dir)

    def spawn(self, host: Host, argv: list[str], env: dict | None = None, console: Path | None = None,
              log_dir: Path | None = None) -> Launch:
        """``argv`` on ``host``: in its network namespace and a UTS namespace of its own with its host name,
        in a session of its own (``stop_all`` kills the session)."""
        console = console or self.workdir / f"{host.hostname}-{len(self.launches)}.console"
        cmd = ["ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c",
               'hostname "$0" && exec "$@"', host.hostname, *argv]
        with open(console, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        launch = Launch(host, proc, console, log_dir or self.workdir / "none")
        self.launches.append(launch)
        return launch

    def launch_both(self, args: list[str], port: int = MASTER_PORT) -> tuple[Launch, Launch]:
        return self.launch(self.a, args, port=port), self.launch(self.b, args, port=port)

    def kill_host(self, host: Host, sig: int = signal.SIGKILL) -> None:
        """The host dies (SIGKILL) or freezes (SIGSTOP): every process in its namespace (torchrun's agent and
        the rank) gets ``sig``. ``stop_all`` and the finaliser kill frozen ones too."""
        for pid in [int(p) for p in _ip("netns", "pids", host.ns, check=False).stdout.split()]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop_all(self) -> None:
        for launch in self.launches:
            if launch.proc.poll() is None:
                try:
                    os.killpg(launch.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                launch.proc.wait(timeout=CMD_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass


def _make_hosts(prefix: str) -> tuple[Host, Host]:
    a = Host(prefix + "a", prefix + "-a", SUBNET + ".1")
    b = Host(prefix + "b", prefix + "-b", SUBNET + ".2")
    for h in (a, b):
        _ip("netns", "add", h.ns)
    _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
    for h in (a, b):
        _ip("link", "set", h.ifname, "netns", h.ns)
        _ip("-n", h.ns, "addr", "add", h.address + "/24", "dev", h.ifname)
        _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("-n", h.ns, "link", "set", h.ifname, "up")
    return a, b


def _check_can_make_hosts() -> None:
    if os.geteuid() != 0:
        pytest.fail("make test-multinode makes network and UTS namespaces: run it as root", pytrace=False)
    for tool in ("ip", "unshare"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            pytest.fail(f"make test-multinode needs `{tool}` (iproute2 / util-linux)", pytrace=False)


@contextlib.contextmanager
def hosts_made(workdir: Path):
    """What ``two_hosts`` yields; on the way out, however it is left: every process it started and every
    process in its namespaces killed, the namespaces (and with them the veth pair) deleted."""
    _check_can_make_hosts()
    _remove_stale()
    prefix = f"{PREFIX}{os.getpid()}"
    hosts = None
    try:
        a, b = _make_hosts(prefix)
        hosts = TwoHosts(a, b, workdir)
        yield hosts
    finally:
        if hosts is not None:
            hosts.stop_all()
        for ns in (prefix + "a", prefix + "b"):
            if ns in _namespaces():
                _kill_namespace(ns)
        _ip("link", "del", prefix + "a", check=False)  # if it never left this namespace
