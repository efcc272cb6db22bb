"""The code sandbox against hostile programs: each limit is triggered by a program that needs it.

Limits are low (CPU 1 s, wall 3 s, 256 MB, 8 processes) so every case is fast and safe for the machine.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox is Linux-only", allow_module_level=True)

from fastcov.trainer.rewards.sandbox import Sandbox, SandboxFusionClient, SandboxLimits, capabilities

LIMITS = SandboxLimits(cpu_s=1, wall_s=3, memory_mb=256, file_size_mb=1, nproc=8, max_output_bytes=64 * 1024)


@pytest.fixture(scope="module")
def box():
    return Sandbox(LIMITS)


def test_a_cgroup_left_by_a_killed_trainer_is_removed(tmp_path, monkeypatch):
    """A trainer killed mid-call leaves its sandbox's (empty) cgroup: the next probe removes those of dead
    processes and leaves the living ones'."""
    from fastcov.trainer.rewards import _sandbox_cgroup

    found = _sandbox_cgroup.own_memory_cgroup()
    if found is None or os.geteuid() != 0:
        pytest.skip("no memory cgroup this process can make children in (not root, or no delegation)")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = found[1] / f"{_sandbox_cgroup.PREFIX}{dead.pid}-1-1"
    live = found[1] / f"{_sandbox_cgroup.PREFIX}{os.getpid()}-1-999999"
    stale.mkdir()
    live.mkdir()
    try:
        _sandbox_cgroup.remove_stale(found[1])
        assert not stale.exists() and live.exists()
    finally:
        for p in (stale, live):
            if p.exists():
                p.rmdir()


def leftovers(workdir: str) -> list[int]:
    """pids of processes still running the program from ``workdir``."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if workdir.encode() in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                pass
    return found


def test_a_good_program_runs(box):
    res = box.run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())))", "1 2 3\n")
    assert res.status == "ok" and res.stdout == "6\n", res
    assert not Path(res.workdir).exists()  # the temp dir is removed


def test_infinite_loop_hits_the_cpu_limit():
    # a wall clock far above the CPU limit: on 2 busy cores one CPU second can take several seconds of wall time
    res = Sandbox(SandboxLimits(cpu_s=1, wall_s=30)).run_python("while True:\n    pass\n")
    assert res.status == "cpu_limit" and res.wall_s < 30, res


def test_sleeping_program_is_killed_at_the_wall_clock(box):
    t0 = time.monotonic()
    res = box.run_python("import time\ntime.sleep(60)\n")
    assert res.status == "timeout" and time.monotonic() - t0 < LIMITS.wall_s + 2, res


@pytest.fixture(params=["as-run", "no-cgroup"])
def without_cgroup(request):
    """The sandbox as this machine runs it, and (where that uses a memory cgroup) without one, as where none can
    be made: both paths must hold."""
    if request.param == "no-cgroup" and not capabilities()["cgroup"]:
        pytest.skip("this machine makes no memory cgroup: the as-run case is this one")
    return request.param == "no-cgroup"


def memory_box(limits: SandboxLimits, without_cgroup: bool) -> Sandbox:
    box = Sandbox(limits)
    if without_cgroup:
        box.caps = {**box.caps, "cgroup": None}
    return box


def test_memory_bomb(without_cgroup):
    box = memory_box(LIMITS, without_cgroup)
    res = box.run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n")
    if box.caps["cgroup"]:  # the kernel's OOM kill in the program's cgroup is what says memory_limit
        assert res.status == "memory_limit" and res.account["oom_kills"] >= 1, res
    else:  # RLIMIT_AS: a MemoryError the kernel does not report, so an ordinary error
        assert res.status == "error" and "MemoryError" in res.stderr, res


def test_fork_bomb_is_bounded_and_reaped(box):
    if not capabilities()["nproc_enforced"]:
        pytest.skip("RLIMIT_NPROC cannot bind here (root without an interpreter 'nobody' can run)")
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
            "except OSError as exc:\n    print('blocked after', n, flush=True)\ntime.sleep(60)\n")
    res = box.run_python(code)
    assert res.status == "timeout", res
    assert res.stdout.startswith("blocked after"), res
    assert int(res.stdout.split()[-1]) < LIMITS.nproc
    deadline = time.monotonic() + 2
    while leftovers(res.workdir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(res.workdir) == []  # the children went with the sandbox


def test_writing_outside_the_work_dir_fails(box, tmp_path):
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable directory outside the sandbox stays closed
    code = (f"import os\nopen('inside.txt', 'w').write('ok')\n"
            f"for p in [{str(target)!r}, '/tmp/fastcov-sandbox-escape.txt']:\n"
            "    try:\n        open(p, 'w').write('pwned')\n        print('WROTE', p)\n"
            "    except OSError as exc:\n        print('denied', type(exc).__name__)\n")
    res = box.run_python(code)
    assert res.status == "ok", res
    assert "WROTE" not in res.stdout and res.stdout.count("denied") == 2, res.stdout
    assert not target.exists() and not Path("/tmp/fastcov-sandbox-escape.txt").exists()
    assert not Path(res.workdir).exists()


def test_a_program_reads_nothing_but_the_interpreter_and_itself(box, tmp_path):
    """A code answer must not read its run's dataset (the tests' expected outputs), the project, other runs
    under /tmp, or /etc; the interpreter still starts and imports its standard library."""
    if not capabilities().get("restrict_reads"):
        pytest.skip("this kernel has no Landlock: the sandbox warns that reads are open")
    data = tmp_path / "runs" / "demo" / "data"
    data.mkdir(parents=True)
    (data / "train.parquet").write_bytes(b"PAR1 expected outputs")
    os.chmod(tmp_path, 0o755)
    for d in (tmp_path / "runs", tmp_path / "runs" / "demo", data):
        os.chmod(d, 0o755)
    os.chmod(data / "train.parquet", 0o644)  # world-readable: only the sandbox's own rule can refuse it
    secrets = [data / "train.parquet", data, Path(__file__).resolve().parents[3] / "README.md", "/tmp",
               "/etc/passwd"]
    code = ("import os, json, re, fractions, decimal, collections, itertools, heapq, statistics\n"
            "open('mine.txt', 'w').write('x')\nprint('own', open('mine.txt').read())\n"
            f"for p in {[str(p) for p in secrets]!r}:\n"
            "    try:\n        os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read()\n        print('READ', p)\n"
            "    except OSError as exc:\n        print('denied', type(exc).__name__)\n")
    res = box.run_python(code)
    assert res.status == "ok", res
    assert "own x" in res.stdout
    assert "READ" not in res.stdout and res.stdout.count("denied PermissionError") == len(secrets), res.stdout


def test_parent_environment_is_not_visible(box, monkeypatch):
    monkeypatch.setenv("FASTCOV_TEST_SECRET", "s3cr3t-token-91")
    code = ("import os, glob\nprint(' '.join(sorted(os.environ)))\nprint(repr(dict(os.environ)))\n"
            "for p in glob.glob('/proc/*/environ'):\n    try:\n        data = open(p, 'rb').read()\n"
            "    except OSError:\n        continue\n    if b's3cr3t' in data:\n        print('LEAK', p)\n")
    res = box.run_python(code)
    assert res.status == "ok", res
    assert "s3cr3t" not in res.stdout and "LEAK" not in res.stdout
    assert set(res.stdout.splitlines()[0].split()) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR",
                                                       "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"}


def test_huge_output_is_capped(box):
    t0 = time.monotonic()
    res = box.run_python("while True:\n    print('x' * 10000)\n")
    assert res.status == "output_limit", res
    assert len(res.stdout) <= LIMITS.max_output_bytes and time.monotonic() - t0 < 2


def test_program_that_closes_stdout(box):
    res = box.run_python("import os\nos.close(1)\nos.close(2)\nprint('hi')\n")
    assert res.status == "error" and res.stdout == "", res
    # and then spins (a wall clock far above the CPU limit: one CPU second can take several on 2 busy cores)
    res = Sandbox(SandboxLimits(cpu_s=1, wall_s=30)).run_python("import os\nos.close(1)\nwhile True:\n    pass\n")
    assert res.status == "cpu_limit", res


def test_file_size_limit(box):
    res = box.run_python("open('big', 'wb').write(b'x' * (4 << 20))\n")
    assert res.status == "file_size_limit", res


def test_no_network(box):
    # a TCP listener and a UDP socket of the parent on loopback: nothing may reach either
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    code = ("import socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=1)\n"
            "    print('tcp connected')\nexcept OSError as exc:\n    print('tcp blocked', exc)\n"
            f"try:\n    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"    u.sendto(b'hello', ('127.0.0.1', {udp.getsockname()[1]}))\n    print('udp sent')\n"
            "except OSError as exc:\n    print('udp blocked', exc)\n")
    res = box.run_python(code)
    assert res.status == "ok", res
    assert "tcp blocked" in res.stdout
    with pytest.raises(socket.timeout):
        srv.accept()
    if capabilities()["namespaces"]:  # UDP is not Landlock's: only the empty network namespace stops it
        assert "udp blocked" in res.stdout, res.stdout
        with pytest.raises(socket.timeout):
            udp.recvfrom(16)
    srv.close()
    udp.close()


def test_sandbox_fusion_backend():
    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.update(body)
            ok = body["stdin"] == "2\n"
            reply = {"status": "Success" if ok else "Failed",
                     "run_result": {"status": "Finished", "stdout": "4\n" if ok else "", "stderr": "",
                                    "return_code": 0 if ok else 1}}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = SandboxFusionClient(f"http://127.0.0.1:{server.server_port}/run_code", LIMITS)
        res = client.run_python("print(int(input()) ** 2)", "2\n")
        assert res.status == "ok" and res.stdout == "4\n"
        assert seen["language"] == "python" and seen["code"].startswith("print")
        assert client.run_python("x", "3\n").status == "error"
    finally:
        server.shutdown()
    dead = SandboxFusionClient("http://127.0.0.1:9/run_code", LIMITS, request_timeout_s=1)
    assert dead.run_python("print(1)").status == "sandbox_error"
    assert SandboxFusionClient.parse_response({"status": "Failed", "run_result": {
        "status": "TimeLimitExceeded"}}).status == "timeout"


def test_unprivileged_path_user_namespace():
    """The launcher as a non-root user: network, pid, mount, IPC and user namespaces (the work dir's tmpfs quota),
    RLIMIT_NPROC counted inside the namespace, Landlock, the seccomp filter. Run here as 'nobody' when the tests
    run as root."""
    import stat
    import subprocess

    from fastcov.trainer.rewards.sandbox import LAUNCHER, _others_can_exec

    readable = bool(LAUNCHER.stat().st_mode & stat.S_IROTH) and _others_can_exec(str(LAUNCHER.parent))
    if os.geteuid() != 0 or not _others_can_exec("/usr/bin/python3") or not readable:
        pytest.skip("needs root (to become 'nobody') and a /usr/bin/python3 'nobody' can run")
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="fastcov-sbx-test-"))  # pytest's tmp_path is private to root
    request_cleanup = lambda: shutil.rmtree(work, ignore_errors=True)  # noqa: E731
    (work / "prog.py").write_text(
        "import os, socket\nprint('uid', os.getuid())\n"
        "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n    u.sendto(b'x', ('127.0.0.1', 9)); print('udp sent')\nexcept OSError:\n    print('udp blocked')\n"
        "try:\n    socket.socket(socket.AF_UNIX); print('unix socket made')\nexcept OSError:\n    print('unix blocked')\n"
        "try:\n    os.memfd_create('m'); print('memfd made')\nexcept OSError:\n    print('memfd blocked')\n"
        "wrote = 0\ntry:\n    for k in range(4):\n        open(f'f{k}', 'wb').write(b'x' * (1 << 20)); wrote += 1\n"
        "except OSError as exc:\n    print('quota', exc.errno)\nprint('files', wrote)\n"
        "n = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(30); os._exit(0)\n"
        "        n += 1\nexcept OSError:\n    print('fork blocked after', n)\n"
        "try:\n    open('/tmp/fastcov-nobody-escape', 'w'); print('WROTE')\nexcept OSError:\n    print('write denied')\n")
    os.chown(work, 65534, 65534)
    spec = {"argv": ["/usr/bin/python3", "-I", "prog.py"], "workdir": str(work), "cpu_s": 2,
            "memory_bytes": 256 << 20, "fsize_bytes": 1 << 20, "disk_bytes": 2 << 20, "nofile": 64, "nproc": 8,
            "netns": True, "pidns": True, "mountns": True, "seccomp": capabilities()["seccomp"], "landlock": True,
            "uid": None, "gid": None}
    try:
        res = subprocess.run(["/usr/bin/python3", "-I", "-S", str(LAUNCHER), json.dumps(spec)], cwd=work,
                             capture_output=True, text=True, timeout=20, user=65534, group=65534,
                             env={"PATH": "/usr/bin:/bin"})
    finally:
        request_cleanup()
    if res.returncode == 199 and "unshare" in res.stderr:
        pytest.skip(f"unprivileged user namespaces are off here: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "uid 65534" in out and "udp blocked" in out and "write denied" in out, out
    assert "quota 28" in out and int(out.split("files ")[1].split()[0]) <= 2, out  # 4 MB asked, 2 MB of tmpfs
    if capabilities()["seccomp"]:
        assert "unix blocked" in out and "memfd blocked" in out, out
    assert int(out.split("fork blocked after")[1].split()[0]) < 8
    assert not Path("/tmp/fastcov-nobody-escape").exists()


# ------------------------------------------------------------------ no way out through sockets, memory or disk

def test_no_unix_socket_is_reachable_by_its_path():
    """A listener outside (a container runtime's socket, an X server, a database) receives nothing: the program
    cannot make an AF_UNIX socket (stream or datagram), re-connect a datagram socketpair to a path, or make an
    AF_VSOCK socket; a stream socketpair (multiprocessing.Pipe) still works."""
    import shutil
    import tempfile

    if not capabilities()["seccomp"]:
        pytest.skip(f"no seccomp filter for {os.uname().machine}: the sandbox warns that unix sockets are open")
    where = Path(tempfile.mkdtemp(prefix="fastcov-sock-test-"))  # pytest's tmp_path is private to root
    os.chmod(where, 0o777)  # the file system lets the program's user connect: only the sandbox may refuse
    stream_path, dgram_path = str(where / "stream.sock"), str(where / "dgram.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(stream_path)
    listener.listen(4)
    listener.settimeout(0.5)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(dgram_path)
    dgram.settimeout(0.5)
    for p in (stream_path, dgram_path):
        os.chmod(p, 0o777)
    code = ("import socket\n"
            "def attempt(name, fn):\n"
            "    try:\n        fn()\n        print('REACHED', name)\n"
            "    except OSError as exc:\n        print('blocked', name, exc.errno)\n"
            "def stream():\n    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            f"    s.connect({stream_path!r})\n    s.sendall(b'x')\n"
            "def dgram():\n    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            f"    s.sendto(b'x', {dgram_path!r})\n"
            "def pair_dgram():\n    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            f"    a.connect({dgram_path!r})\n    a.send(b'x')\n"
            "def vsock():\n    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).connect((2, 22))\n"
            "for name, fn in [('stream', stream), ('dgram', dgram), ('pair_dgram', pair_dgram), ('vsock', vsock)]:\n"
            "    attempt(name, fn)\n"
            "a, b = socket.socketpair()\na.sendall(b'pipe')\nprint('pair', b.recv(4).decode())\n")
    try:
        res = Sandbox(LIMITS).run_python(code)
        assert res.status == "ok", res
        assert "REACHED" not in res.stdout and res.stdout.count("blocked") == 4 and "pair pipe" in res.stdout, \
            res.stdout
        with pytest.raises(socket.timeout):
            listener.accept()
        with pytest.raises(socket.timeout):
            dgram.recv(16)
    finally:
        listener.close()
        dgram.close()
        shutil.rmtree(where, ignore_errors=True)


MEMFD = ("import os\nheld = 0\ntry:\n    for i in range(60):\n        fd = os.memfd_create(f'm{i}')\n"
         "        for _ in range(8):\n            os.write(fd, b'x' * (1 << 20))\n        held += 8 << 20\n"
         "except OSError as exc:\n    print('refused', exc.errno)\n")
SYSV = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
        "held = 0\nsid = libc.shmget(0, 480 << 20, 0o1600)\n"  # IPC_PRIVATE, IPC_CREAT | 0600
        "if sid < 0:\n    print('refused', ctypes.get_errno())\nelse:\n"
        "    addr = libc.shmat(sid, None, 0)\n    libc.shmctl(sid, 0, None)\n"  # IPC_RMID: gone at detach
        "    ctypes.memset(addr, 1, 480 << 20)\n    libc.shmdt(ctypes.c_void_p(addr))\n    held = 480 << 20\n")
POSIX = ("import os\nheld = 0\ntry:\n    fd = os.open('/dev/shm/fastcov-sbx-test', os.O_CREAT | os.O_RDWR, 0o600)\n"
         "    os.unlink('/dev/shm/fastcov-sbx-test')\n"
         "    for _ in range(8):\n        os.write(fd, b'x' * (1 << 20))\n        held += 1 << 20\n"
         "except OSError as exc:\n    print('refused', exc.errno)\n")
HEAP = ("chunks = []\ntry:\n    while len(chunks) < 8:\n        chunks.append(bytearray(50 << 20))\n"
        "except MemoryError:\n    pass\nprint('held', held >> 20, 'heap', len(chunks) * 50)\n")


MEMORY_LIMITS = SandboxLimits(cpu_s=5, wall_s=20, memory_mb=512, file_size_mb=8, nofile=64)


@pytest.mark.parametrize("channel", ["memfd", "sysv_shm", "posix_shm"])
def test_memory_outside_the_address_space_counts_against_the_limit(channel, without_cgroup):
    """480 MB in memfds (60 of 8 MB, each under the file size limit), a SysV segment or /dev/shm, then 400 MB of
    heap, against a 512 MB limit: what the program holds in all, whatever the channel, stays within the limit."""
    hold = {"memfd": MEMFD, "sysv_shm": SYSV, "posix_shm": POSIX}[channel]
    limits = MEMORY_LIMITS
    res = memory_box(limits, without_cgroup).run_python(hold + HEAP)
    assert res.status in ("ok", "memory_limit"), res
    if res.status == "ok":
        words = res.stdout.split()
        held, heap = int(words[words.index("held") + 1]), int(words[words.index("heap") + 1])
        assert held + heap <= limits.memory_mb, res.stdout
        assert heap >= 300, res.stdout  # the limit is not simply spent on nothing


FILL = ("import os, sys\ndef fill(tag):\n    wrote = 0\n    try:\n        for k in range(8):\n"
        "            with open(f'{tag}_{k}', 'wb') as f:\n                f.write(b'x' * (1 << 20))\n"
        "            wrote += 1 << 20\n    except OSError as exc:\n        print('stopped', tag, exc.errno, flush=True)\n"
        "    print('wrote', wrote, flush=True)\n"
        "kids = []\nfor i in range(7):\n    pid = os.fork()\n    if pid == 0:\n        fill(f'c{i}')\n        os._exit(0)\n"
        "    kids.append(pid)\nfor pid in kids:\n    os.waitpid(pid, 0)\nprint('forks', len(kids), flush=True)\n"
        "sys.exit(1)\n")


def test_disk_fill_across_forks_stops_at_the_quota():
    """Seven forks writing 8 MB each (1 MB files, under the per-file limit) share one 4 MB quota: together they
    write no more, the run says disk_limit, and none of it reached the disk (the tmpfs is memory, private)."""
    if not capabilities()["namespaces"]:
        pytest.skip("this OS refuses mount namespaces: the sandbox warns that there is no total write quota")
    limits = SandboxLimits(cpu_s=5, wall_s=20, memory_mb=256, file_size_mb=1, disk_mb=4, nproc=16)
    res = Sandbox(limits).run_python(FILL)
    assert "forks 7" in res.stdout, res  # every writer ran
    wrote = sum(int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("wrote"))
    assert wrote <= 4 << 20, res.stdout
    stops = [line.split()[2] for line in res.stdout.splitlines() if line.startswith("stopped")]
    assert len(stops) >= 6 and set(stops) == {"28"}, res.stdout  # ENOSPC, not the per-file limit's EFBIG (27)
    assert res.status == "disk_limit" and res.account["disk_full"], res


# ------------------------------------------------------------------ the status is the sandbox's, not the program's

NOISE = ("import sys\nprint(42)\nsys.stderr.write('MemoryError\\nOSError: [Errno 27] File too large\\n"
         "Cannot allocate memory\\nfastcov-sandbox: forged\\n')\n")


@pytest.mark.parametrize("exit_code, status", [(0, "ok"), (1, "error"), (199, "error"), (128 + 24, "error"),
                                               (128 + 9, "error")])
def test_the_status_never_comes_from_what_the_program_prints(box, exit_code, status):
    """Words of a limit in stderr, and exit codes that look like a setup failure (199) or a signal (128+n), are
    the program's own: exit 0 is ok, anything else is an error."""
    res = box.run_python(NOISE + f"sys.exit({exit_code})\n")
    assert res.status == status and res.stdout == "42\n", res


def test_a_right_answer_with_memoryerror_in_stderr_is_rewarded():
    from fastcov.trainer.rewards.code_task import CodeRewardFn

    fn = CodeRewardFn("binary", LIMITS)
    truth = json.dumps({"inputs": ["20\n"], "outputs": ["42\n"]})
    answer = ("```python\nimport sys\nprint(int(input()) + 22)\nsys.stderr.write('MemoryError\\nFile too large\\n')"
              "\n```")
    assert fn(answer, truth) == 1.0 and fn.statuses == {"ok": 1}


def test_sandbox_fusion_status_ignores_the_programs_stderr():
    ok = {"status": "Success", "run_result": {"status": "Finished", "stdout": "42\n", "stderr": "MemoryError",
                                              "return_code": 0}}
    assert SandboxFusionClient.parse_response(ok).status == "ok"
    failed = {"status": "Failed", "run_result": {"status": "Finished", "stderr": "MemoryError", "return_code": 1}}
    assert SandboxFusionClient.parse_response(failed).status == "error"
