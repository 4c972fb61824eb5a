"""The call protocol: the program the zygote runs (``_ZYGOTE``), the config a call's process
applies (written by :func:`_call_config`, read by ``enter`` in it), the ready line and exit
status it reports, and its captured output."""

from __future__ import annotations

import collections
import os
import platform
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nemo_orch.tools.sandbox import seccomp
from nemo_orch.tools.sandbox.identity import _count_processes
from nemo_orch.tools.sandbox.limits import SandboxLimits
from nemo_orch.tools.sandbox.plan import _Plan
from nemo_orch.tools.sandbox.root import _KEYCTL, _PIVOT_ROOT, _mount_point

_READY = b"ready\n"
_TAIL_BYTES = 2048
_CPU_EXIT = 128 + signal.SIGXCPU

# The zygote: one per pool, started with the interpreter, this program and the modules calls
# commonly import loaded. For each request on its control socket (a JSON config and the pipe
# ends of a call's stdin, stdout and exit status) it forks a child and answers with its pid. The
# child makes itself a session of its own, enters its cgroups and fresh namespaces (network,
# mount, PID) and forks the call's process (the new PID namespace's first), whose exit status it
# writes to the status pipe. The call's process mounts what it may see (the private root),
# applies the limits, drops to its uid, says it is ready, then reads the code from stdin and
# executes it as ``__main__``. User code is compiled as "<sandbox>" and registered with
# linecache so tracebacks show its source lines.
_ZYGOTE = r"""
import atexit, ctypes, gc, json, linecache, os, resource, signal, socket, sys, traceback, types
import collections, datetime, decimal, fractions, functools, itertools, math, random, re
import statistics, string, time
# {"namespaces": bool, "control": fd, "parent": pid, "staging": {"path", "directories"}}, on
# stdin: argv, which every call inherits in /proc/self/cmdline, holds nothing of the host's.
ZYGOTE = json.loads(sys.stdin.buffer.read())
def identity(name):
    with open(f"/proc/self/{name}") as f:
        return "".join(f"{inside} {inside} {count}\n"
                       for inside, _, count in (line.split() for line in f))
IDENTITY = {name: identity(name) for name in ("uid_map", "gid_map")}
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWCGROUP, CLONE_NEWUSER = (
    0x08000000, 0x04000000, 0x02000000, 0x10000000)
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING = 1, 7, -4
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
PR_SET_DUMPABLE, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 4, 1, 38, 22
SECCOMP_MODE_FILTER = 2
class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
def check(failed, what):
    if failed:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), what)
# What a read-only remount of a bind keeps of its mount's flags: in a user namespace of the
# call's, those of a mount made outside it are locked, and a remount that drops one fails.
KEPT_FLAGS = ((os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, 1024),
              (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21))
def kept_flags(path):
    flags = os.statvfs(path).f_flag
    return sum(ms for st, ms in KEPT_FLAGS if flags & st)
def mount(source, target, fstype, flags, data):
    check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                     flags, data and data.encode()), target)
def enter(cfg):
    # In the call's own namespaces: what it may see, its limits, its uid.
    for hidden, exposed in cfg["mounts"]:
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in exposed]
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for p, fd in zip(exposed, fds):
            os.makedirs(p, 0o755, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC, None)
            os.close(fd)
    root = cfg["root"]
    if root is not None:
        # A tmpfs holding only what the call may see, entered with pivot_root: the host's tree
        # is detached. Binds are made read-only; /tmp, /var/tmp and /dev/shm are fresh and empty.
        new = root["path"]
        mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
        # Scratch first: the worker's directory, even the interpreter (a checkout in /tmp), may
        # live under /tmp, and their links and binds go inside it.
        for directory in root["scratch"]:
            os.makedirs(new + directory, 0o755, exist_ok=True)
            mount("tmpfs", new + directory, "tmpfs", MS_NOSUID | MS_NODEV,
                  f"mode=1777,size={root['scratch_bytes']}")
        for link, destination in root["links"]:
            os.makedirs(os.path.dirname(new + link), 0o755, exist_ok=True)
            os.symlink(destination, new + link)
        for source, target, writable in root["binds"]:
            inside = new + target
            if os.path.isdir(source):
                os.makedirs(inside, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(inside), 0o755, exist_ok=True)
                open(inside, "a").close()
            mount(source, inside, None, MS_BIND | MS_REC, None)
            if not writable:
                mount(None, inside, None,
                      MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept_flags(inside), None)
        if cfg["disk"] is not None:
            os.makedirs(new + cfg["workdir"], 0o755, exist_ok=True)
            mount("tmpfs", new + cfg["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, cfg["disk"])
        # The IPC namespace's own POSIX message queues.
        os.makedirs(new + "/dev/mqueue", 0o755, exist_ok=True)
        mount("mqueue", new + "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        for directory in root["covers"]:
            mount("tmpfs", new + directory, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
        os.makedirs(new + "/proc", 0o555, exist_ok=True)
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV, None)
        os.chdir(new)
        check(libc.syscall(root["pivot_root"], b".", b"."), "pivot_root")
        check(libc.umount2(b".", 2), "umount the host's root")  # MNT_DETACH
        mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755")
    elif cfg["disk"] is not None:
        mount("tmpfs", cfg["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, cfg["disk"])
    os.chdir(cfg["workdir"])
    for name, (soft, hard) in cfg["rlimits"].items():
        limit = getattr(resource, name)
        current = resource.getrlimit(limit)[1]
        if current != resource.RLIM_INFINITY:
            hard = min(hard, current)
        resource.setrlimit(limit, (min(soft, hard), hard))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
        if cfg["keyctl"] is not None:
            # A fresh session keyring, and the uid's user keyring emptied of what an earlier
            # call (this uid is this call's alone now) added.
            check(libc.syscall(cfg["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0,
                  "a session keyring")
            check(libc.syscall(cfg["keyctl"], KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING) < 0,
                  "clear the user keyring")
        if cfg["userns"]:
            own_user_namespace(cfg["uid"])
    check(cfg["no_new_privs"] and libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    def cpu_exceeded(signum, frame):
        os.write(2, b"\nCPU time limit exceeded\n")
        os._exit(cfg["cpu_exit"])
    signal.signal(signal.SIGXCPU, cpu_exceeded)
    os.umask(0o077)
    os.environ.clear()
    os.environ.update(cfg["env"])
    sys.path.extend(cfg["sys_path"])
    if cfg["seccomp"] is not None:
        # Last: it denies what the setup above needed (mounts, unshare).
        program = bytes.fromhex(cfg["seccomp"])
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER,
                         ctypes.byref(SockFprog(len(program) // 8, program)), 0, 0), "seccomp")
def own_user_namespace(uid):
    # A user namespace of the call's own, its uid mapped to itself: keyrings (user, persistent)
    # are this namespace's and die with it, and no further user namespace can be made in it.
    # /proc/self is writable by the process only while it is dumpable (setuid cleared that).
    check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "PR_SET_DUMPABLE")
    check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{uid} {uid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    # The capabilities the new namespace gave are dropped, so the limit stays.
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")
def become(cfg, stdin, stdout, status, mapped=None):
    # The forked child: its own session, cgroups and namespaces. The call runs in a child of
    # it (the new PID namespace's first process), which it waits for; it writes that child's
    # exit status to the sandbox's status pipe, which the call's code never holds.
    # ``mapped``: the pipes of the zygote's handshake (map_ids) where the namespaces are owned
    # by a user namespace of the call's.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    for path in cfg["cgroup_procs"]:
        with open(path, "w") as f:
            f.write("0")
    if mapped is not None:
        # A user namespace first, so the ones below are its: the kernel broadcasts (uevents)
        # to network namespaces of the initial user namespace only. It maps the ids the
        # zygote's does, to themselves (the zygote writes the maps: only a process outside
        # may map more than its own uid).
        ready, go = mapped
        check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        os.write(ready, b"u")
        check(os.read(go, 1) != b"m", "the zygote mapping the user namespace's ids")
        os.close(ready)
        os.close(go)
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    os.dup2(stdout, 2)
    os.dup2(status, 3)
    os.closerange(4, os.sysconf("SC_OPEN_MAX"))
    os.setsid()
    if ZYGOTE["namespaces"]:
        # The cgroup namespace after entering the cgroups: they are its root.
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
                           | CLONE_NEWUTS | CLONE_NEWCGROUP), "unshare")
        check(libc.sethostname(b"sandbox", 7), "sethostname")
    pid = os.fork()
    if pid:
        for fd in (0, 1, 2):
            os.close(fd)
        os.write(3, b"%d" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        os._exit(0)
    os.close(3)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    if ZYGOTE["namespaces"]:
        mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        if cfg["root"] is None:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            if os.path.isdir("/dev/mqueue"):
                mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
def execute():
    # Compile and run a line once before the call: the pages that takes (copied from the
    # zygote's on first write) are this process's before its code arrives.
    exec(compile("str(sum(range(3))).encode()", "<warm-up>", "exec"), {})
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    source = sys.stdin.buffer.read().decode("utf-8", "replace")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    linecache.cache["<sandbox>"] = (len(source), None, source.splitlines(True), "<sandbox>")
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    sys.argv = [""]
    sys.path.insert(0, "")
    try:
        exec(compile(source, "<sandbox>", "exec"), main.__dict__)
        code = 0
    except SystemExit as exit:
        code = exit.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException as exc:
        sys.stdout.flush()
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        code = 1
    # What the interpreter's exit does that a program can see (its threads joined, its atexit
    # functions run, its output flushed), without tearing down the zygote's modules.
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code or 0)
def stage(path, directories):
    # Once per pool, in a mount namespace of the zygote's own that its children copy: a
    # read-only tmpfs with a directory per library directory, holding binds of its libraries,
    # so a call binds each directory (its libraries come with it) rather than each file.
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for index, (_, files) in enumerate(directories):
        os.mkdir(f"{path}/{index}", 0o755)
        for source, name in files:
            target = f"{path}/{index}/{name}"
            open(target, "a").close()
            mount(source, target, None, MS_BIND, None)
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None)
    mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
def map_ids(pid, ready, go):
    # The zygote's side of become's handshake: once the child is in its new user namespace,
    # map the ids the zygote's namespace maps, each to itself. A child that died first has
    # nothing to map (its end of ``ready`` closed).
    os.close(ready[1])
    os.close(go[0])
    try:
        if os.read(ready[0], 1) == b"u":
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(IDENTITY[name])
            os.write(go[1], b"m")
    except OSError:
        pass  # the child dies on the missing answer: its spawn fails and says why
    finally:
        os.close(ready[0])
        os.close(go[1])
def serve():
    control = socket.socket(fileno=ZYGOTE["control"])
    # It dies with the sandbox's process, however that ends (and its children with it).
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    if os.getppid() != ZYGOTE["parent"]:
        return
    if ZYGOTE["staging"] is not None:
        stage(ZYGOTE["staging"]["path"], ZYGOTE["staging"]["directories"])
    # What is loaded now stays out of the children's garbage collections, which would otherwise
    # touch (and so copy) every page of it.
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its children are reaped by the kernel
    # A SLURM job's processes all get SIGUSR1 before its time limit (the training stops on it);
    # for the zygote and its calls it is no reason to die.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    while True:
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
        if not message:
            return  # the sandbox closed the socket
        cfg = json.loads(message)
        handshake = [os.pipe(), os.pipe()] if cfg["owned_namespaces"] else None
        pid = os.fork()
        if pid == 0:
            try:
                if handshake is not None:  # the zygote's ends: a read must see its death
                    os.close(handshake[0][0])
                    os.close(handshake[1][1])
                become(cfg, *fds, mapped=handshake and (handshake[0][1], handshake[1][0]))
                enter(cfg)
            except BaseException:
                traceback.print_exc()
                sys.stdout.flush()
                os._exit(1)
            execute()  # never returns: the call's process exits
        for fd in fds:
            os.close(fd)
        control.send(json.dumps({"id": cfg["id"], "pid": pid}).encode())
        if handshake is not None:
            map_ids(pid, *handshake)
serve()
"""
# The interpreter the zygote runs, by its real path: a virtual environment's alias would name
# the checkout it lives in, and calls see their interpreter's path (``sys.executable``).
INTERPRETER = os.path.realpath(sys.executable)
# Where a call works inside its private root, the same for every call (no host path, no pid).
WORKDIR = "/home/sandbox"
# The zygote's environment, and each call's with its HOME and TMPDIR: nothing of this process's
# (tokens, keys) is inherited.
_ZYGOTE_ENVIRONMENT = {
    "PATH": f"{Path(INTERPRETER).parent}:/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # One BLAS/OpenMP thread: each extra thread reserves address space that counts against
    # RLIMIT_AS, and one call should not take every core.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _call_config(
    plan: _Plan,
    limits: SandboxLimits,
    workdir: Path,
    cgroups: list[Path],
    uid: int | None,
    staging: str | None,
) -> dict:
    """What the zygote's child applies (``enter`` in ``_ZYGOTE``); ``staging``: where its
    zygote staged the library directories."""
    memory = limits.memory_mb << 20
    nproc = limits.max_processes
    if uid is None and os.geteuid() != 0:
        # RLIMIT_NPROC counts all processes of the (shared) uid: allow what already runs.
        nproc += _count_processes(os.getuid())
    disk = None
    if plan.namespaces:
        # The working directory: a tmpfs of the call's mount namespace, owned by its uid; it
        # bounds what the call writes there and goes with the namespace.
        disk = f"mode=0700,size={limits.max_disk_mb << 20}"
        if uid is not None:
            disk += f",uid={uid},gid={uid}"
    root = (
        None
        if plan.root is None
        else {
            "path": str(_mount_point(workdir)),
            "binds": [
                *plan.root.binds,
                *[
                    (f"{staging}/{index}", directory, False)
                    for index, (directory, _) in enumerate(plan.root.staged)
                ],
            ],
            "links": plan.root.links,
            "covers": plan.root.covers,
            "scratch": plan.root.scratch,
            "scratch_bytes": limits.max_file_mb << 20,
            "pivot_root": _PIVOT_ROOT[platform.machine()],
        }
    )
    # Inside a private root the call works in a fixed directory; elsewhere in the host's.
    inside = str(workdir) if root is None else WORKDIR
    return {
        "cgroup_procs": [str(group / "cgroup.procs") for group in cgroups],
        "mounts": [[hidden, list(exposed)] for hidden, exposed in plan.mounts],
        "root": root,
        "rlimits": {
            "RLIMIT_CPU": [limits.cpu_seconds, limits.cpu_seconds + 1],
            "RLIMIT_AS": [memory, memory],
            "RLIMIT_FSIZE": [limits.max_file_mb << 20] * 2,
            "RLIMIT_NPROC": [nproc, nproc],
            "RLIMIT_CORE": [0, 0],
        },
        "uid": uid,
        "keyctl": _KEYCTL.get(platform.machine()),
        "userns": plan.userns,
        "disk": disk,
        "no_new_privs": True,
        "owned_namespaces": plan.owned_namespaces,
        "sys_path": list(plan.sys_path),
        "seccomp": seccomp.program(arch).hex()
        if plan.seccomp and (arch := seccomp.host_arch())
        else None,
        "cpu_exit": _CPU_EXIT,
        "workdir": inside,
        # A fresh environment: nothing of the parent's (tokens, keys) is inherited.
        "env": {
            **_ZYGOTE_ENVIRONMENT,
            "HOME": inside,
            "TMPDIR": inside if root is None else "/tmp",
        },
    }


@dataclass
class _Output:
    """Captured output kept to ``limit`` bytes (head) plus a small tail, so tracebacks after a
    flood of output stay visible while the parent's memory stays bounded."""

    limit: int
    head: bytearray = field(default_factory=bytearray)
    tail: collections.deque = field(default_factory=collections.deque)
    tail_size: int = 0
    total: int = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail.append(data[-_TAIL_BYTES:])
            self.tail_size += len(self.tail[-1])
            while self.tail_size - len(self.tail[0]) >= _TAIL_BYTES:
                self.tail_size -= len(self.tail.popleft())

    def text(self) -> str:
        head = self.head.decode("utf-8", "replace")
        if self.total <= self.limit:
            return head
        tail = b"".join(self.tail)[-_TAIL_BYTES:]
        skipped = self.total - self.limit - len(tail)
        marker = f"\n[output truncated after {self.limit} bytes"
        marker += f"; {skipped} bytes omitted, last {len(tail)} follow]\n" if skipped else "]\n"
        return head + marker + tail.decode("utf-8", "replace")
