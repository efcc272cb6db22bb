"""The sandbox's launcher: run as ``python -I -S _sandbox_launcher.py SPEC_JSON`` by trainer/rewards/sandbox.py.

Standard library only (it runs with -S, no site-packages, and must not import fastcov). It applies the
isolation in a fresh single-threaded process, then execs the untrusted program:

    launcher ──(unshare: net [+ user] [+ pid] namespaces)──fork──► init (pid 1 of the new pid namespace)
                                                                     └─fork──► program: rlimits, no_new_privs,
                                                                               Landlock, uid drop, exec

When init exits every process left in its pid namespace is killed by the kernel, and init dies with the
launcher (parent-death signal), so a wall-clock kill of the launcher's process group reaps forks that
escaped the group. Exit status: the program's code, or 128 + signal when a signal ended it.
Status 199 with a "fastcov-sandbox:" line on stderr means the isolation itself could not be set up.
"""

import ctypes
import json
import os
import resource
import signal
import sys
from typing import Any, NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
SYS_LANDLOCK_CREATE_RULESET = 444  # the same number on x86_64 and aarch64 (generic syscall table)
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
SETUP_FAILED = 199

libc = ctypes.CDLL(None, use_errno=True)


def fail(msg: str) -> NoReturn:
    sys.stderr.write(f"fastcov-sandbox: {msg}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def unshare(flags: int) -> None:
    if libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        fail(f"unshare({flags:#x}) failed: {os.strerror(err)}")


def landlock_abi() -> int:
    v = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return v if v > 0 else 0


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


READ_FS = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE, READ_FILE, READ_DIR
FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14)  # EXECUTE, WRITE_FILE, READ_FILE, TRUNCATE


def landlock(workdir: str, abi: int, read_paths: list[str] | None = None) -> None:
    """Writes only beneath ``workdir`` (and to /dev/null); with ``read_paths`` (a list), reads and execution
    only beneath those paths and ``workdir`` as well; with ABI >= 4 no TCP bind/connect; with ABI >= 6 no
    signals or abstract unix sockets outside the sandbox. /proc/<pid>/environ of processes outside the
    sandbox's domain is unreadable (Landlock's ptrace restriction)."""
    write_fs = 0
    for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12):  # WRITE_FILE, REMOVE_*, MAKE_*
        write_fs |= 1 << bit
    if abi >= 2:
        write_fs |= 1 << 13  # REFER
    if abi >= 3:
        write_fs |= 1 << 14  # TRUNCATE
    reads = read_paths is not None
    fields = [ctypes.c_uint64(write_fs | (READ_FS if reads else 0))]
    if abi >= 4:
        fields.append(ctypes.c_uint64((1 << 0) | (1 << 1)))  # BIND_TCP | CONNECT_TCP, no rule: denied
    if abi >= 6:
        fields.append(ctypes.c_uint64((1 << 0) | (1 << 1)))  # scope: ABSTRACT_UNIX_SOCKET | SIGNAL
    attr = (ctypes.c_uint64 * len(fields))(*[f.value for f in fields])
    fd = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                      ctypes.c_uint32(0))
    if fd < 0:
        fail(f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}")
    file_rights = (1 << 1) | ((1 << 14) if abi >= 3 else 0)  # WRITE_FILE (+ TRUNCATE) on /dev/null
    rules = [(workdir, write_fs | (READ_FS if reads else 0)), ("/dev/null", file_rights | (1 << 2 if reads else 0))]
    rules += [(p, READ_FS) for p in read_paths or [] if os.path.exists(p)]
    for path, rights in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            fail(f"landlock: cannot open {path}: {exc}")
        if not os.path.isdir(path):
            rights &= FILE_RIGHTS  # Landlock refuses directory rights on a file
        rule = PathBeneath(rights, pfd)
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule),
                        ctypes.c_uint32(0)) != 0:
            fail(f"landlock_add_rule({path}) failed: {os.strerror(ctypes.get_errno())}")
        os.close(pfd)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("prctl(NO_NEW_PRIVS) failed")
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
        fail(f"landlock_restrict_self failed: {os.strerror(ctypes.get_errno())}")
    os.close(fd)


def limits(spec: dict[str, Any]) -> None:
    def setl(which: int, soft: int, hard: int | None = None) -> None:
        resource.setrlimit(which, (soft, soft if hard is None else hard))

    setl(resource.RLIMIT_CORE, 0)
    cpu = max(1, int(spec["cpu_s"] + 0.999))
    setl(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU at the soft limit, SIGKILL a second later
    setl(resource.RLIMIT_AS, spec["memory_bytes"])
    setl(resource.RLIMIT_FSIZE, spec["fsize_bytes"])
    setl(resource.RLIMIT_NOFILE, spec["nofile"])
    setl(resource.RLIMIT_NPROC, spec["nproc"])


def exec_program(spec: dict[str, Any]) -> NoReturn:
    """In the program's process: limits, confinement, uid drop, exec. Never returns."""
    workdir = spec["workdir"]
    try:
        limits(spec)
    except (ValueError, OSError) as exc:
        fail(f"setrlimit failed: {exc}")
    abi = landlock_abi() if spec["landlock"] else 0
    if abi:
        landlock(workdir, abi, spec.get("read_paths"))
    uid = spec["uid"]
    if uid is not None:
        try:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(uid)
        except OSError as exc:
            fail(f"cannot drop to uid {uid}: {exc}")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after the uid change, which clears it
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir(workdir)
    for s in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(s, signal.SIG_DFL)
    try:
        os.execve(spec["argv"][0], spec["argv"], dict(os.environ))
    except OSError as exc:
        fail(f"cannot run {spec['argv'][0]}: {exc}")


def wait_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def init(spec: dict[str, Any]) -> NoReturn:
    """pid 1 of the sandbox's pid namespace: run the program, reap orphans, exit with its status."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    prog = os.fork()
    if prog == 0:
        exec_program(spec)
    code = None
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == prog:
            code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            break  # exiting kills every process left in the namespace
    os._exit(code if code is not None else SETUP_FAILED)


def main() -> NoReturn:
    spec = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    flags = 0
    if spec["netns"]:
        flags |= CLONE_NEWNET
    if spec["pidns"]:
        flags |= CLONE_NEWPID
    if flags and os.geteuid() != 0:
        flags |= CLONE_NEWUSER
    if flags:
        uid, gid = os.getuid(), os.getgid()
        unshare(flags)
        if flags & CLONE_NEWUSER:  # map the user to itself: no root inside, RLIMIT_NPROC still binds
            write("/proc/self/setgroups", "deny")
            write("/proc/self/uid_map", f"{uid} {uid} 1\n")
            write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    if not spec["pidns"]:
        exec_program(spec)
    child = os.fork()
    if child == 0:
        init(spec)
    code = wait_status(child)
    os._exit(code)


if __name__ == "__main__":
    main()
