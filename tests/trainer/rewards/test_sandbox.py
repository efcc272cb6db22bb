"""The code sandbox against hostile programs: each limit is triggered by a program that needs it.

Limits are low (CPU 1 s, wall 3 s, 256 MB, 8 processes) so every case is fast and safe for the machine.
"""

import json
import os
import socket
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


def test_infinite_loop_hits_the_cpu_limit(box):
    res = box.run_python("while True:\n    pass\n")
    assert res.status == "cpu_limit" and res.wall_s < LIMITS.wall_s, res


def test_sleeping_program_is_killed_at_the_wall_clock(box):
    t0 = time.monotonic()
    res = box.run_python("import time\ntime.sleep(60)\n")
    assert res.status == "timeout" and time.monotonic() - t0 < LIMITS.wall_s + 2, res


def test_memory_bomb(box):
    res = box.run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n")
    assert res.status == "memory_limit", res


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
    res = box.run_python("import os\nos.close(1)\nwhile True:\n    pass\n")  # and then spins
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
    """The launcher as a non-root user (CI's case): network, pid and user namespaces, RLIMIT_NPROC counted
    inside the namespace, Landlock. Run here as 'nobody' when the tests run as root."""
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
        "n = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(30); os._exit(0)\n"
        "        n += 1\nexcept OSError:\n    print('fork blocked after', n)\n"
        "try:\n    open('/tmp/fastcov-nobody-escape', 'w'); print('WROTE')\nexcept OSError:\n    print('write denied')\n")
    os.chown(work, 65534, 65534)
    spec = {"argv": ["/usr/bin/python3", "-I", "prog.py"], "workdir": str(work), "cpu_s": 2,
            "memory_bytes": 256 << 20, "fsize_bytes": 1 << 20, "nofile": 64, "nproc": 8, "netns": True,
            "pidns": True, "landlock": True, "uid": None, "gid": None}
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
    assert int(out.split("fork blocked after")[1].split()[0]) < 8
    assert not Path("/tmp/fastcov-nobody-escape").exists()
