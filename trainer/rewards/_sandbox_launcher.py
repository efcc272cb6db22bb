"""The sandbox's launcher: run as ``python -I -S _sandbox_launcher.py SPEC_JSON`` by trainer/rewards/sandbox.py.

Standard library only (it runs with -S, no site-packages, and must not import fastcov). It applies the
isolation in a fresh single-threaded process, then execs the untrusted program:

    launcher ──unshare: net, pid, mount, IPC [+ user] namespaces──► a size-limited tmpfs over the work dir
       └─fork──► init (pid 1 of the new pid namespace)
                   └─fork──► program: cgroup, rlimits, Landlock, uid drop, seccomp filter, exec

When init exits every process left in its pid namespace is killed by the kernel, and init dies with the
launcher (parent-death signal), so a wall-clock kill of the launcher's process group reaps forks that
escaped the group. The tmpfs lives in the launcher's private mount namespace: what the program writes never
reaches the disk and is gone with the namespace.

Exit status: the program's code, or 128 + signal when a signal ended it. The trusted account of the run goes
to the report descriptor (``spec["report_fd"]``, closed before the program starts), one JSON object a line:
``{"setup_error": msg}`` when the isolation could not be set up (also on stderr after "fastcov-sandbox:",
exit status 199); ``{"exit": code, "signal": n or null, "cpu_s": s}`` from init's wait for the program;
``{"disk_full": bool, "file_size_hit": bool, "disk_bytes": n}`` from the tmpfs after every process is gone.
The caller builds the run's status from these alone, never from what the program printed.
"""

import ctypes
import json
import os
import resource
import signal
import sys
from typing import Any, NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
SYS_LANDLOCK_CREATE_RULESET = 444  # the same number on x86_64 and aarch64 (generic syscall table)
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
SETUP_FAILED = 199
DISK_INODES = 4096  # files and folders the work dir's tmpfs holds (each costs the kernel memory)

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
REPORT_FD = -1  # the report descriptor (spec["report_fd"]), -1 when the caller wants none


def report(**fields: Any) -> None:
    """One line of the trusted account (module docstring) to the caller; nothing when it asked for none."""
    if REPORT_FD >= 0:
        try:
            os.write(REPORT_FD, (json.dumps(fields) + "\n").encode())
        except OSError:
            pass


def fail(msg: str) -> NoReturn:
    report(setup_error=msg)
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


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(v: str | None) -> bytes | None:
        return None if v is None else v.encode()

    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        fail(f"mount({fstype or source or ''} on {target}) failed: {os.strerror(ctypes.get_errno())}")


def private_work_dir(spec: dict[str, Any]) -> None:
    """In the launcher's fresh mount namespace: a tmpfs of ``disk_bytes`` over the work dir, the program's
    only writable place (Landlock denies writes elsewhere), holding a copy of what the caller put there.
    Every process of the program shares it, so its size is the call's total write quota (forks included);
    it is memory, never the disk, and goes away with the namespace."""
    workdir = spec["workdir"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates back to the host
    old = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    uid = os.getuid() if spec["uid"] is None else spec["uid"]
    gid = os.getgid() if spec["gid"] is None else spec["gid"]
    mount("fastcov-sandbox", workdir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={int(spec['disk_bytes'])},nr_inodes={DISK_INODES},mode=0700,uid={uid},gid={gid}")
    for name in os.listdir(old):
        try:
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=old)
            with os.fdopen(src, "rb") as f:
                data = f.read()
            dst = os.path.join(workdir, name)
            with open(dst, "wb") as f:
                f.write(data)
            os.chown(dst, uid, gid)
        except OSError as exc:
            fail(f"cannot copy {name} into the work dir: {exc}")
    os.close(old)


def disk_account(workdir: str, fsize_bytes: int) -> dict[str, Any]:
    """What the program left in its tmpfs, read once every process of it is gone: whether the quota ran out
    (no block or no inode free) and whether a file reached the per-file limit (RLIMIT_FSIZE stops every write
    at exactly that size). Symbolic links are not followed."""
    st = os.statvfs(workdir)
    full = st.f_bavail * st.f_frsize < 4096 or st.f_favail == 0
    hit, stack, seen = False, [workdir], 0
    while stack and not hit and seen < 2 * DISK_INODES:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            seen += 1
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_size >= fsize_bytes:
                    hit = True
            except OSError:
                continue
    return {"disk_full": full, "file_size_hit": hit, "disk_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize}


# ------------------------------------------------------------------------------------------ seccomp

# The system calls the filter refuses (EPERM), per architecture (audit arch, numbers). socket() is allowed for
# AF_INET/AF_INET6 only (the empty network namespace confines those; AF_UNIX would reach any listener by its
# path, AF_VSOCK the host of a VM, and neither is namespaced); socketpair() for stream and seqpacket pairs
# only (a datagram pair can be re-connected to a path); memfd_create/memfd_secret and SysV shared memory and
# message queues hold memory outside the address-space limit; io_uring can open and connect sockets without
# the filter seeing the call.
AF_INET, AF_INET6, SOCK_STREAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 2, 10, 1, 5, 0xF
SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, {"socket": 41, "socketpair": 53, "memfd_create": 319, "memfd_secret": 447,
                            "shmget": 29, "msgget": 68, "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427}),
    "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "memfd_create": 279, "memfd_secret": 447,
                             "shmget": 194, "msgget": 186, "io_uring_setup": 425, "io_uring_enter": 426,
                             "io_uring_register": 427}),
}
X32_SYSCALL_BIT = 0x40000000
RET_ALLOW, RET_KILL_PROCESS, RET_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | 1
LD_W_ABS, JEQ, JGE, AND, RET = 0x20, 0x15, 0x35, 0x54, 0x06


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


Instruction = tuple[Any, Any, Any, int]  # (code or a label, jump if true, jump if false, k)


def seccomp_program(machine: str) -> list[Instruction]:
    """The filter as (code, jump-if-true, jump-if-false, k); jumps name a label (a str) or 0 (the next one)."""
    arch, nr = SECCOMP_ARCHES[machine]
    prog: list[Instruction] = [
        (LD_W_ABS, 0, 0, 4), (JEQ, 0, "kill", arch),  # another ABI (i386 via int 0x80) is killed
        (LD_W_ABS, 0, 0, 0),
    ]
    if machine == "x86_64":
        prog.append((JGE, "deny", 0, X32_SYSCALL_BIT))  # the x32 ABI's numbers alias the 64-bit ones
    for name in ("memfd_create", "memfd_secret", "shmget", "msgget", "io_uring_setup", "io_uring_enter",
                 "io_uring_register"):
        prog.append((JEQ, "deny", 0, nr[name]))
    prog += [(JEQ, "socket", 0, nr["socket"]), (JEQ, "socketpair", 0, nr["socketpair"]), (RET, 0, 0, RET_ALLOW),
             ("socket", 0, 0, 0), (LD_W_ABS, 0, 0, 16),  # args[0] (low 32 bits): the domain
             (JEQ, "allow", 0, AF_INET), (JEQ, "allow", "deny", AF_INET6),
             ("socketpair", 0, 0, 0), (LD_W_ABS, 0, 0, 24), (AND, 0, 0, SOCK_TYPE_MASK),  # args[1]: the type
             (JEQ, "allow", 0, SOCK_STREAM), (JEQ, "allow", "deny", SOCK_SEQPACKET),
             ("allow", 0, 0, 0), (RET, 0, 0, RET_ALLOW),
             ("deny", 0, 0, 0), (RET, 0, 0, RET_EPERM),
             ("kill", 0, 0, 0), (RET, 0, 0, RET_KILL_PROCESS)]
    return prog


def assemble(prog: list[Instruction]) -> list[tuple[int, int, int, int]]:
    """Resolve labels (entries whose code is a str mark where they are) into BPF's relative forward jumps."""
    where: dict[str, int] = {}
    body: list[Instruction] = []
    for ins in prog:
        if isinstance(ins[0], str):
            where[ins[0]] = len(body)
        else:
            body.append(ins)
    out = []
    for i, (code, jt, jf, k) in enumerate(body):
        rel = [where[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
        if not all(0 <= r < 256 for r in rel):
            raise ValueError(f"seccomp: jump out of range at {i}")
        out.append((code, rel[0], rel[1], k))
    return out


def seccomp() -> None:
    """Install the filter (needs no_new_privs, set before); inherited by every fork and kept across exec."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCHES:
        fail(f"seccomp: no filter for the {machine} architecture")
    body = assemble(seccomp_program(machine))
    filters = (SockFilter * len(body))(*[SockFilter(*ins) for ins in body])
    fprog = SockFprog(len(body), ctypes.cast(filters, ctypes.POINTER(SockFilter)))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        fail(f"seccomp filter refused: {os.strerror(ctypes.get_errno())}")


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
    setl(resource.RLIMIT_AS, spec["as_bytes"] if spec.get("as_bytes") else spec["memory_bytes"])
    setl(resource.RLIMIT_FSIZE, spec["fsize_bytes"])
    setl(resource.RLIMIT_NOFILE, spec["nofile"])
    setl(resource.RLIMIT_NPROC, spec["nproc"])
    setl(resource.RLIMIT_MSGQUEUE, 0)  # POSIX message queues: kernel memory outside the address space


def join_cgroup(procs: str) -> None:
    """Move this process (and so every fork of the program) into the caller's memory cgroup, which counts all
    it holds: heap, page cache, tmpfs, pipes, kernel memory."""
    try:
        write(procs, str(os.getpid()))
    except OSError as exc:
        fail(f"cannot join the cgroup {os.path.dirname(procs)}: {exc}")


def exec_program(spec: dict[str, Any]) -> NoReturn:
    """In the program's process: cgroup, limits, confinement, uid drop, seccomp, exec. Never returns."""
    workdir = spec["workdir"]
    if spec.get("cgroup_procs"):
        join_cgroup(spec["cgroup_procs"])
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
    if spec.get("seccomp"):
        seccomp()
    os.chdir(workdir)
    for s in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(s, signal.SIG_DFL)
    try:
        os.execve(spec["argv"][0], spec["argv"], dict(os.environ))  # the report descriptor is close-on-exec
    except OSError as exc:
        fail(f"cannot run {spec['argv'][0]}: {exc}")


def init(spec: dict[str, Any]) -> NoReturn:
    """pid 1 of the sandbox's pid namespace: run the program, reap orphans, report how the program ended (its
    exit code or signal, its CPU time, as the kernel's wait gives them) and exit with its status."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    prog = os.fork()
    if prog == 0:
        exec_program(spec)
    code = None
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if pid == prog:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            code = 128 + sig if sig else os.WEXITSTATUS(status)
            report(exit=None if sig else code, signal=sig, cpu_s=usage.ru_utime + usage.ru_stime)
            break  # exiting kills every process left in the namespace
    os._exit(code if code is not None else SETUP_FAILED)


def main() -> NoReturn:
    global REPORT_FD
    spec = json.loads(sys.argv[1])
    REPORT_FD = spec.get("report_fd", -1)
    if REPORT_FD >= 0:
        os.set_inheritable(REPORT_FD, False)  # the program's exec closes it
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    flags = 0
    if spec["netns"]:
        flags |= CLONE_NEWNET
    if spec["pidns"]:
        flags |= CLONE_NEWPID
    if spec.get("mountns"):
        flags |= CLONE_NEWNS | CLONE_NEWIPC  # IPC: whatever SysV object slips through dies with the namespace
    if flags and os.geteuid() != 0:
        flags |= CLONE_NEWUSER
    if flags:
        uid, gid = os.getuid(), os.getgid()
        unshare(flags)
        if flags & CLONE_NEWUSER:  # map the user to itself: no root inside, RLIMIT_NPROC still binds
            write("/proc/self/setgroups", "deny")
            write("/proc/self/uid_map", f"{uid} {uid} 1\n")
            write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    if spec.get("mountns"):
        private_work_dir(spec)
    if not spec["pidns"]:
        exec_program(spec)
    child = os.fork()
    if child == 0:
        init(spec)
    _, status, _ = os.wait4(child, 0)
    code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    if spec.get("mountns"):
        report(**disk_account(spec["workdir"], spec["fsize_bytes"]))
    os._exit(code)


if __name__ == "__main__":
    main()
