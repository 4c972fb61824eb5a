"""The ``python_sandbox`` tool: model-written Python in a contained, throwaway process.

Each call runs in its own process, forked for it and discarded afterwards, so hostile code can
never poison the next call. The process is contained by the strongest mechanisms the host allows,
probed once at start (``PythonSandbox.isolation`` says which are in force):

* ``netns`` / ``pidns``: private network (no route out, not even 127.0.0.1) and PID namespaces,
  fresh for each call; when the call's process ends the kernel kills everything it spawned, and
  no host process is visible.
* ``ipcns`` / ``utsns`` / ``cgroupns``: SysV shared memory, message queues and semaphores and
  POSIX message queues (its own ``/dev/mqueue``) are the call's and vanish with it; its
  hostname is ``sandbox``; ``/proc/self/cgroup`` shows its own cgroups as the root.
* ``tmpfs-workdir``: the working directory is a tmpfs of ``max_disk_mb`` in the call's mount
  namespace: writes past it fail (ENOSPC) and it goes with the namespace, with nothing for the
  host to remove.
* ``uid``: the code runs as an unprivileged uid of its own (``uid_base + n``), which no other
  worker on the host holds at the same time (a lock file per uid, ``flock``-ed for the
  worker's life), so it cannot write root's files, read other processes' environments or
  signal other sandboxes, and ``RLIMIT_NPROC`` binds (it does not bind root). ``keyrings``: it
  joins a fresh session keyring and its uid's user keyring is emptied first.
* ``userns``: it then enters a user namespace of its own (its uid mapped to itself, no
  capabilities) in which no further user namespace can be made; the user and persistent
  keyrings it sees are that namespace's and die with it. Where the host refuses one, the
  uid's persistent keyring is shared by calls of that uid (logged as a warning).
* ``private-root``: the code sees a root of its own (a tmpfs entered with ``pivot_root``, the
  host's tree detached): the interpreter, its standard library (without site-packages) and
  ``libpython``, the ``allowed_packages`` (default: none beyond the standard library) and
  only the shared libraries these load (their ELF dependencies, found with ``ldd`` once per
  process and staged once per pool by the zygote, so a call binds a directory of them, not
  each file), all read-only; a few device nodes; its working directory; private, empty ``/tmp``,
  ``/var/tmp`` and ``/dev/shm``; ``/proc`` of its PID namespace. Nothing else of the host
  (datasets, checkouts, configuration, other users' temporary files) exists for it, and
  nothing it writes outside its directory outlives the call. No shell (``/bin/sh``) is there:
  subprocesses run ``sys.executable``.
* ``mountns`` (the fallback where a private root cannot be made): when the interpreter lives
  under a directory the unprivileged uid cannot search (e.g. ``/root/.pyenv``), that directory
  is covered by an empty tmpfs in a private mount namespace and only the interpreter's prefixes
  are bound back in; the host's world-readable files stay readable (logged as a warning).
* ``cgroup-pids`` / ``cgroup-memory``: a cgroup per worker bounds the process count and the
  memory of the whole tree, and lets the tree be killed completely: in a delegated cgroup v2
  subtree (``cgroup-v2``, the default of current distributions) or under the cgroup v1
  controllers. Groups a killed sandbox left behind are removed at the next start.
* ``rlimits`` (always): CPU seconds, address space, file size, process count; plus a wall-clock
  timeout that kills the process group, a fresh working directory, an environment without the
  parent's variables, and ``no-new-privs`` so setuid binaries cannot regain privileges.

Every call's process is forked from a zygote, one per pool, that has the interpreter and the
standard modules calls commonly import loaded; the fork then takes what must be its own: a
session, its cgroups, fresh network, mount, PID, IPC, UTS and cgroup namespaces (it forks again
to be the PID namespace's first process, so the kernel kills everything it spawns when it ends),
its private root with an empty ``/tmp``, its uid (and user namespace), limits, working
directory and an empty environment. A child whose zygote dies dies with it; a zygote that exits
or answers unexpectedly is replaced.
Workers are forked ahead (``pool_size``) up to the point where they wait for code on stdin, so
a call costs handing over the code, running it and the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import functools
import importlib.util
import itertools
import json
import logging
import os
import platform
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_orch.tools.base import BaseTool, Pricing, ToolContext, ToolError, ToolResult, ToolSpec, Usage

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("auto", "strict", "rlimits")

# Comparable to hosted code interpreters: about $0.03 per CPU-hour of a small container plus
# overhead, i.e. ~1e-5 USD/s; 1e-4 USD/s (0.36 USD/hour) deliberately prices a sandbox second
# at roughly one call of a small LLM so the policy learns not to burn time in loops.
SANDBOX_USD_PER_SECOND = 1e-4

_READY = b"ready\n"
_TAIL_BYTES = 2048
_CPU_EXIT = 128 + signal.SIGXCPU
_SPAWN_TIMEOUT_S = 30.0
_KILL_TIMEOUT_S = 5.0
# Workers' uids are uid_base + [0, _UID_COUNT), each held by one worker on the host at a time: a
# lock file per uid under _UID_LOCKS, flock'ed for the worker's life (a killed holder's lock dies
# with its descriptors). Each process starts its search at its own offset to meet fewer taken ones.
_UID_COUNT = 1000
_UID_LOCKS = "nemo-orch-sandbox-uids"
_UID_NEXT = itertools.count(os.getpid() % _UID_COUNT)
# Numbers runs process-wide: several sandboxes in one process name their cgroups apart.
_RUN_NUMBERS = itertools.count()
# A zygote's staged libraries are mounted (in its own mount namespace) on
# <temporary directory>/nemo_orch_sandbox_libs.<sandbox pid>.<random>.
_STAGING_PREFIX = "nemo_orch_sandbox_libs."
# Worker groups are <parent>/nemo_orch_sandbox.<sandbox pid>.<run number>; V2 stands for the
# unified hierarchy's group, which takes both of _V2_CONTROLLERS.
_GROUP_PREFIX = "nemo_orch_sandbox."
V2 = "v2"
_V2_CONTROLLERS = ("pids", "memory")

# The zygote: one per pool, started with the interpreter, this program and the modules calls
# commonly import loaded. For each request on its control socket (a JSON config and the pipe
# ends of a call's stdin, stdout and exit status) it forks a child and answers with its pid. The
# child makes itself a session of its own, enters its cgroups and fresh namespaces (network,
# mount, PID) and forks the call's process (the new PID namespace's first), whose exit status it
# writes to the status pipe. The call's process mounts what it may see (the private root),
# applies the limits, drops to its uid, says it is ready, then reads the code from stdin and
# executes it as ``__main__``. User code is compiled as "<sandbox>" and registered with
# linecache so tracebacks show its source lines.
_ZYGOTE = r'''
import atexit, ctypes, gc, json, linecache, os, resource, signal, socket, sys, traceback, types
import collections, datetime, decimal, fractions, functools, itertools, math, random, re
import statistics, string, time
# {"namespaces": bool, "control": fd, "parent": pid, "staging": {"path", "directories"}}
ZYGOTE = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWCGROUP, CLONE_NEWUSER = (
    0x08000000, 0x04000000, 0x02000000, 0x10000000)
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING = 1, 7, -4
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
PR_SET_DUMPABLE, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 4, 1, 38
def check(failed, what):
    if failed:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), what)
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
                mount(None, inside, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None)
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
def become(cfg, stdin, stdout, status):
    # The forked child: its own session, cgroups and namespaces. The call runs in a child of
    # it (the new PID namespace's first process), which it waits for; it writes that child's
    # exit status to the sandbox's status pipe, which the call's code never holds.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    os.dup2(stdout, 2)
    os.dup2(status, 3)
    os.closerange(4, os.sysconf("SC_OPEN_MAX"))
    os.setsid()
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    for path in cfg["cgroup_procs"]:
        with open(path, "w") as f:
            f.write("0")
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
    while True:
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
        if not message:
            return  # the sandbox closed the socket
        cfg = json.loads(message)
        pid = os.fork()
        if pid == 0:
            try:
                become(cfg, *fds)
                enter(cfg)
            except BaseException:
                traceback.print_exc()
                sys.stdout.flush()
                os._exit(1)
            execute()  # never returns: the call's process exits
        for fd in fds:
            os.close(fd)
        control.send(json.dumps({"id": cfg["id"], "pid": pid}).encode())
serve()
'''
# The zygote's environment, and each call's with its HOME and TMPDIR: nothing of this process's
# (tokens, keys) is inherited.
_ZYGOTE_ENVIRONMENT = {
    "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
    # One BLAS/OpenMP thread: each extra thread reserves address space that counts against
    # RLIMIT_AS, and one call should not take every core.
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits. ``cpu_seconds`` is CPU time of the main process (``RLIMIT_CPU``);
    ``memory_mb`` bounds each process's address space and, with ``cgroup-memory``, the tree;
    ``max_disk_mb`` bounds the working directory (a tmpfs, where there is a mount namespace)."""

    timeout_s: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    max_file_mb: int = 16
    max_processes: int = 32
    max_output_bytes: int = 16384
    max_disk_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_seconds", "memory_mb", "max_file_mb", "max_processes",
                     "max_output_bytes", "max_disk_mb"):
            if getattr(self, name) <= 0:
                raise ToolError(f"python_sandbox: {name} must be > 0")


def default_spec() -> ToolSpec:
    """The spec the policy sees; billed per second of sandbox time (see SANDBOX_USD_PER_SECOND)."""
    return ToolSpec(
        name="python_sandbox",
        description=("Run a Python 3 program in a fresh, isolated process and return what it "
                     "printed (stdout and stderr). No network access, no state kept between "
                     "calls; print the values you need."),
        parameters={"type": "object",
                    "properties": {"code": {"type": "string",
                                            "description": "A complete Python program."}},
                    "required": ["code"]},
        pricing=Pricing(per_second=SANDBOX_USD_PER_SECOND),
        latency_hint_s=0.2,
        timeout_s=30.0,
    )


@dataclass(frozen=True)
class PrivateRoot:
    """What a worker's private root holds (``private-root``): host paths bound read-only at
    the same place (``binds``: the interpreter, its standard library, the allowed packages,
    each shared library these load, a few device nodes, which are writable), symlinks
    (``links``: the host's ``/lib -> usr/lib`` and the like, ``/dev/fd``, the interpreter's
    aliases), empty read-only directories over what a bound tree holds beyond what is allowed
    (``covers``: the interpreter's own site-packages), and private empty tmpfs directories
    (``scratch``). The worker's directory is bound writable; ``/proc`` is its PID
    namespace's. Library directories (``staged``: each with its libraries, as (file, name))
    are read-only directories the zygote makes once, and each call binds whole."""

    binds: tuple[tuple[str, str, bool], ...]
    links: tuple[tuple[str, str], ...]
    covers: tuple[str, ...]
    staged: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    scratch: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class _Plan:
    """How workers are made: whether each gets fresh network, mount, PID, IPC, UTS and cgroup
    namespaces and a tmpfs working directory (``namespaces``; on a host where this process is
    not root the zygote runs in a user namespace of its own, root there), which uid they drop
    to and whether they then enter a user namespace of their own (``userns``), which
    directories are re-exposed in the mount namespace (or the private root they see instead),
    and the cgroup parents used."""

    namespaces: bool = False
    uid_base: int | None = None
    mounts: tuple[tuple[str, tuple[str, ...]], ...] = ()
    cgroups: tuple[tuple[str, Path], ...] = ()
    root: PrivateRoot | None = None
    userns: bool = False

    @property
    def zygote_prefix(self) -> tuple[str, ...]:
        """What the zygote is started under: a user namespace where this process is not root
        (creating the others needs root in the namespace that owns them)."""
        if self.namespaces and os.geteuid() != 0:
            return ("unshare", "--user", "--map-root-user", "--")
        return ()

    @property
    def isolation(self) -> tuple[str, ...]:
        names = []
        if self.namespaces:
            names += ["netns", "pidns", "ipcns", "utsns", "cgroupns", "tmpfs-workdir"]
        if self.root is not None:
            names.append("private-root")
        if self.mounts:
            names.append("mountns")
        if self.uid_base is not None:
            names += ["uid"] + (["keyrings"] if platform.machine() in _KEYCTL else [])
        if self.userns:
            names.append("userns")
        for controller, _ in self.cgroups:
            names += ([f"cgroup-{name}" for name in _V2_CONTROLLERS] + ["cgroup-v2"]
                      if controller == V2 else [f"cgroup-{controller}"])
        return (*names, "rlimits", "no-new-privs")


@dataclass
class _Child:
    """A call's process, forked by the zygote: the host pid of its session, the pipes to its
    stdin and from its stdout and stderr, and its exit status (``exited``: as
    ``asyncio.subprocess.Process.returncode``, negative for a signal), which its session's
    first process writes to a pipe of its own (a killed session writes none: SIGKILL)."""

    pid: int
    stdin: asyncio.StreamWriter
    stdout: asyncio.StreamReader
    exited: asyncio.Task

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)


async def _exit_status(status: asyncio.StreamReader) -> int:
    text = await status.read()
    return int(text) if text.lstrip(b"-").isdigit() else -signal.SIGKILL


class _Zygote:
    """The process a pool's calls are forked from (``_ZYGOTE``): the interpreter and the
    common standard modules loaded once, so a call's process costs a fork and its namespaces
    and mounts, not an interpreter start. Requests and answers travel over a Unix socket (a
    request carries the call's pipe ends); a call's end does not involve it. Anything
    unexpected from it (it exits, a request fails or gets no answer in time, an answer that
    does not parse) marks it ``failed`` and kills it, and the sandbox starts another; the
    children it forked die with it (``PR_SET_PDEATHSIG``)."""

    def __init__(self, proc: asyncio.subprocess.Process, control: socket.socket,
                 staging: str | None) -> None:
        self.proc, self.control, self.staging = proc, control, staging
        self.failed: str | None = None
        self._ids = itertools.count()
        self._forks: dict[int, asyncio.Future] = {}
        self._listener = asyncio.create_task(self._listen())

    @classmethod
    async def start(cls, plan: _Plan) -> "_Zygote":
        # Where the zygote mounts its staged libraries (empty in this mount namespace).
        staging = None
        if plan.root is not None and plan.root.staged:
            _remove_stale_staging()
            staging = tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{os.getpid()}.")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                *plan.zygote_prefix, sys.executable, "-I", "-u", "-c", _ZYGOTE,
                json.dumps({"namespaces": plan.namespaces, "control": theirs.fileno(),
                            "parent": os.getpid(),
                            "staging": staging and {"path": staging,
                                                    "directories": plan.root.staged}}),
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                env=_ZYGOTE_ENVIRONMENT, start_new_session=True)
        except BaseException:
            ours.close()
            if staging is not None:
                os.rmdir(staging)
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours, staging)

    async def fork(self, config: dict) -> _Child:
        """A child for ``config`` (what :func:`enter` applies), its stdin and stdout piped
        here."""
        if self.failed is not None:
            raise _SpawnError(f"the zygote failed: {self.failed}")
        loop = asyncio.get_running_loop()
        request = next(self._ids)
        # Their ends: the call's stdin, its stdout and stderr, its session's exit status.
        ours, theirs = zip(*[(read, write) if index else (write, read) for index, (read, write)
                             in enumerate(os.pipe() for _ in range(3))])
        answer = self._forks[request] = loop.create_future()
        try:
            socket.send_fds(self.control, [json.dumps({**config, "id": request}).encode()],
                            list(theirs))
            pid = await asyncio.wait_for(answer, _SPAWN_TIMEOUT_S)
        except BaseException as error:
            for fd in ours:
                os.close(fd)
            self._forks.pop(request)  # before _fail: nobody awaits it any more
            self._fail(f"fork request: {error!r}")
            raise _SpawnError(f"the zygote did not fork: {error!r}") from None
        else:
            self._forks.pop(request)
        finally:
            for fd in theirs:
                os.close(fd)
        stdin, stdout, status = ours
        readers = [asyncio.StreamReader(limit=1 << 20) for _ in range(2)]
        for reader, fd in zip(readers, (stdout, status)):
            await loop.connect_read_pipe(lambda reader=reader: asyncio.StreamReaderProtocol(
                reader), os.fdopen(fd, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                            os.fdopen(stdin, "wb", 0))
        return _Child(pid, asyncio.StreamWriter(transport, protocol, None, loop), readers[0],
                      asyncio.create_task(_exit_status(readers[1])))

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while message := await loop.sock_recv(self.control, 4096):
                answer = json.loads(message)
                self._forks[answer["id"]].set_result(answer["pid"])
            self._fail("it exited")
        except (OSError, ValueError, KeyError, asyncio.InvalidStateError) as error:
            self._fail(f"{type(error).__name__}: {error}")

    def _fail(self, reason: str) -> None:
        """Mark it failed and kill it (its children die with it)."""
        if self.failed is None:
            self.failed = reason
            logger.warning("python_sandbox: replacing the zygote (%s)", reason)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        for future in self._forks.values():
            if not future.done():
                future.set_exception(_SpawnError(reason))

    async def close(self) -> None:
        """Stop it (its idle children die with it) and wait for it to exit."""
        self.control.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()
        self._listener.cancel()
        await asyncio.gather(self._listener, return_exceptions=True)
        if self.staging is not None:
            os.rmdir(self.staging)


@dataclass
class _Worker:
    proc: _Child
    workdir: Path
    cgroups: list[Path]
    lease: _UidLease | None
    zygote: _Zygote

    @property
    def alive(self) -> bool:
        """Neither it nor its zygote (which it dies with) has ended, as far as is known."""
        return self.proc.returncode is None and self.zygote.failed is None


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


class _SpawnError(RuntimeError):
    pass


class PythonSandbox(BaseTool):
    """Runs ``{"code": str}`` in a pre-started, single-use, contained worker process."""

    def __init__(self, spec: ToolSpec, *, timeout_s: float = 10.0, cpu_seconds: int = 10,
                 memory_mb: int = 1024, max_file_mb: int = 16, max_processes: int = 32,
                 max_output_bytes: int = 16384, pool_size: int = 2, isolation: str = "auto",
                 uid_base: int = 60000, allowed_packages: Sequence[str] = (),
                 max_disk_mb: int = 64) -> None:
        super().__init__(spec)
        if isolation not in ISOLATION_MODES:
            raise ToolError(f"python_sandbox: isolation must be one of {ISOLATION_MODES}")
        if pool_size < 0:
            raise ToolError("python_sandbox: pool_size must be >= 0")
        self.limits = SandboxLimits(timeout_s, cpu_seconds, memory_mb, max_file_mb,
                                    max_processes, max_output_bytes, max_disk_mb)
        self.pool_size = pool_size
        self.isolation_mode = isolation
        self.uid_base = uid_base
        self.allowed_packages = tuple(allowed_packages)
        self._plan: _Plan | None = None
        self._zygote: _Zygote | None = None
        self._plan_lock, self._zygote_lock = asyncio.Lock(), asyncio.Lock()
        self._idle: collections.deque[_Worker] = collections.deque()
        self._spawning = 0
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    @property
    def isolation(self) -> tuple[str, ...]:
        """The mechanisms in force (empty before ``start``/the first call)."""
        return self._plan.isolation if self._plan else ()

    @property
    def cgroup_parents(self) -> tuple[Path, ...]:
        """Directories in which per-worker cgroups are created (for inspection and tests)."""
        return tuple(parent for _, parent in self._plan.cgroups) if self._plan else ()

    async def start(self) -> None:
        """Probe the isolation available and fill the worker pool."""
        await self._ensure_plan()
        self._refill()
        await asyncio.gather(*list(self._tasks))

    async def close(self) -> None:
        """Kill idle workers and remove their cgroups and directories; waits for retirements."""
        self._closed = True
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        while self._idle:
            await self._destroy(self._idle.popleft())
        if self._zygote is not None:
            await self._zygote.close()

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        started = time.perf_counter()
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(error="argument 'code' must be a string")
        try:
            worker = await self._acquire()
        except (_SpawnError, ToolError) as exc:
            return self._result("", f"sandbox failed to start: {exc}", started)
        try:
            output, error = await self._run(worker, code)
        finally:
            self._background(self._destroy(worker))
        return self._result(output, error, started)

    def _result(self, output: str, error: str | None, started: float) -> ToolResult:
        seconds = time.perf_counter() - started
        return ToolResult(output=output, error=error, latency_s=seconds,
                          cost_usd=self.spec.pricing.cost(Usage(), seconds))

    # ----------------------------------------------------------------------------- the pool

    async def _acquire(self) -> _Worker:
        if self._closed:
            raise ToolError("the sandbox is closed")
        await self._ensure_plan()
        while self._idle:
            worker = self._idle.popleft()
            self._refill()
            if worker.alive:
                return worker
            self._background(self._destroy(worker))
        self._refill()
        return await self._spawn(self._plan)

    def _refill(self) -> None:
        while not self._closed and len(self._idle) + self._spawning < self.pool_size:
            self._spawning += 1
            self._background(self._spawn_into_pool())

    async def _spawn_into_pool(self) -> None:
        try:
            worker = await self._spawn(self._plan)
        except _SpawnError as exc:
            logger.warning("python_sandbox: could not pre-start a worker: %s", exc)
            return
        finally:
            self._spawning -= 1
        if self._closed:
            await self._destroy(worker)
        else:
            self._idle.append(worker)

    def _background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------------ one worker

    async def _zygote_for(self, plan: _Plan) -> _Zygote:
        """The pool's zygote, started (again, if the last one failed) for ``plan``."""
        async with self._zygote_lock:  # spawns run side by side: one replacement
            if self._zygote is None or self._zygote.failed is not None:
                failed, self._zygote = self._zygote, await _Zygote.start(plan)
                if failed is not None:
                    self._background(failed.close())
            return self._zygote

    async def _spawn(self, plan: _Plan, zygote: _Zygote | None = None) -> _Worker:
        seq = next(_RUN_NUMBERS)
        lease = None if plan.uid_base is None else await asyncio.to_thread(_lease_uid,
                                                                           plan.uid_base)
        uid = None if lease is None else lease.uid
        try:
            workdir, cgroups = await asyncio.to_thread(self._prepare, plan, seq, uid)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        worker = None
        try:
            zygote = zygote or await self._zygote_for(plan)
            proc = await zygote.fork(self._call_config(plan, workdir, cgroups, uid,
                                                       zygote.staging))
            worker = _Worker(proc, workdir, cgroups, lease, zygote)
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), _SPAWN_TIMEOUT_S)
            except asyncio.TimeoutError:
                line = b"(no answer within %d s)" % _SPAWN_TIMEOUT_S
            if line != _READY:
                rest = b"" if proc.stdout.at_eof() else await _read_some(proc.stdout)
                raise _SpawnError((line + rest).decode("utf-8", "replace").strip()[-2000:]
                                  or f"exit status {await proc.wait()}")
            return worker
        except BaseException:
            if worker is not None:
                await self._destroy(worker)
            else:
                await asyncio.to_thread(_remove, workdir, cgroups)
                if lease is not None:
                    lease.release()
            raise

    def _prepare(self, plan: _Plan, seq: int, uid: int | None) -> tuple[Path, list[Path]]:
        """Create the worker's directory (owned by its uid) and cgroups (with their limits)."""
        workdir = Path(tempfile.mkdtemp(prefix="nemo_orch_sandbox_"))
        if uid is not None:
            os.chown(workdir, uid, uid)
        if plan.root is not None:
            _mount_point(workdir).mkdir()
        cgroups = []
        try:
            for controller, parent in plan.cgroups:
                group = parent / f"{_GROUP_PREFIX}{os.getpid()}.{seq}"
                group.mkdir()
                cgroups.append(group)
                _write_cgroup_limits(controller, group, self.limits)
        except OSError:
            _remove(workdir, cgroups)
            raise
        return workdir, cgroups

    def _call_config(self, plan: _Plan, workdir: Path, cgroups: list[Path],
                     uid: int | None, staging: str | None) -> dict:
        """What the zygote's child applies (``enter`` in ``_ZYGOTE``); ``staging``: where its
        zygote staged the library directories."""
        limits = self.limits
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
        root = None if plan.root is None else {
            "path": str(_mount_point(workdir)),
            "binds": [*plan.root.binds,
                      *[(f"{staging}/{index}", directory, False)
                        for index, (directory, _) in enumerate(plan.root.staged)]],
            "links": plan.root.links, "covers": plan.root.covers,
            "scratch": plan.root.scratch, "scratch_bytes": limits.max_file_mb << 20,
            "pivot_root": _PIVOT_ROOT[platform.machine()]}
        return {
            "cgroup_procs": [str(group / "cgroup.procs") for group in cgroups],
            "mounts": [[hidden, list(exposed)] for hidden, exposed in plan.mounts],
            "root": root,
            "rlimits": {"RLIMIT_CPU": [limits.cpu_seconds, limits.cpu_seconds + 1],
                        "RLIMIT_AS": [memory, memory],
                        "RLIMIT_FSIZE": [limits.max_file_mb << 20] * 2,
                        "RLIMIT_NPROC": [nproc, nproc],
                        "RLIMIT_CORE": [0, 0]},
            "uid": uid,
            "keyctl": _KEYCTL.get(platform.machine()),
            "userns": plan.userns,
            "disk": disk,
            "no_new_privs": True,
            "cpu_exit": _CPU_EXIT,
            "workdir": str(workdir),
            # A fresh environment: nothing of the parent's (tokens, keys) is inherited.
            "env": {**_ZYGOTE_ENVIRONMENT, "HOME": str(workdir), "TMPDIR": str(workdir)},
        }

    async def _run(self, worker: _Worker, code: str) -> tuple[str, str | None]:
        proc = worker.proc
        output = _Output(self.limits.max_output_bytes)
        reader = asyncio.create_task(_drain(proc.stdout, output))
        timed_out = False
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                try:
                    proc.stdin.write(code.encode("utf-8", "replace"))
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the worker died first; its exit status says why
                await proc.wait()
        except TimeoutError:
            timed_out = True
        # Whatever it left running (background children) dies now, which closes the pipe.
        oom_kills = await asyncio.to_thread(_kill_tree, worker)
        await proc.wait()
        try:
            await asyncio.wait_for(reader, _KILL_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass  # an escaped process still holds the pipe; the output so far is what we have
        text = output.text()
        return text, self._error(proc.returncode, timed_out, oom_kills, text)

    def _error(self, returncode: int, timed_out: bool, oom_kills: int, text: str) -> str | None:
        limits = self.limits
        if timed_out:
            return f"timed out after {float(limits.timeout_s)} s"
        if oom_kills or (returncode == 1 and text.rstrip().rsplit("\n", 1)[-1]
                         .startswith("MemoryError")):
            return f"exceeded the memory limit ({limits.memory_mb} MB)"
        if returncode in (_CPU_EXIT, -signal.SIGXCPU):
            return f"exceeded the CPU time limit ({limits.cpu_seconds} s)"
        if returncode < 0:
            return f"killed by signal {signal.Signals(-returncode).name}"
        if returncode > 0:
            return f"exit status {returncode}"
        return None

    async def _destroy(self, worker: _Worker) -> None:
        await asyncio.to_thread(_kill_tree, worker)
        worker.proc.stdin.close()
        await worker.proc.wait()
        await asyncio.to_thread(_remove, worker.workdir, worker.cgroups)
        if worker.lease is not None:
            worker.lease.release()  # its processes are gone: another worker may take the uid

    # ------------------------------------------------------------------------ detection

    async def _ensure_plan(self) -> None:
        async with self._plan_lock:
            if self._plan is None:
                self._plan = await self._detect()
                logger.info("python_sandbox isolation: %s", ", ".join(self._plan.isolation))

    async def _detect(self) -> _Plan:
        """Try candidate plans from the strongest down with a canary program; the first that
        runs it correctly is used. ``strict`` accepts only the strongest."""
        if self.isolation_mode == "rlimits":
            return _Plan()
        cgroups = tuple(await asyncio.to_thread(_usable_cgroups, self.limits))
        if not cgroups:
            logger.warning("python_sandbox: no writable cgroup (a delegated v2 subtree or the v1 "
                           "pids and memory controllers): per-process limits only")
        root = os.geteuid() == 0
        # Where this process is not root, the zygote needs `unshare` for its user namespace.
        namespaces = root or shutil.which("unshare") is not None
        mounts = _hidden_prefixes() if namespaces else ()
        private = None
        if namespaces and platform.machine() in _PIVOT_ROOT:
            private = await asyncio.to_thread(_private_root, self.allowed_packages)
        uid_base = self.uid_base if root else None
        # Each with a user namespace per call first (where it drops to a uid), then without.
        candidates = [_Plan(namespaces, uid_base, (), cgroups, private, userns)
                      for userns in (root, False)] if private else []
        if root:
            candidates += [_Plan(namespaces, self.uid_base, mounts, cgroups, userns=userns)
                           for userns in (namespaces, False)]
            candidates.append(_Plan(False, self.uid_base, (), cgroups))
        candidates += [_Plan(namespaces, None, (), cgroups), _Plan(False, None, (), cgroups)]
        if self.isolation_mode == "strict":
            candidates = candidates[:1]
        failures = []
        for plan in dict.fromkeys(candidates):
            failure = await self._probe(plan)
            if failure is None:
                if plan.root is None:
                    logger.warning(
                        "python_sandbox: no private root (%s): sandboxed code can read every "
                        "world-readable file of this host and write to its /tmp, /var/tmp and "
                        "/dev/shm", "; ".join(failures) or "no mount namespace here")
                if plan.uid_base is not None and not plan.userns:
                    logger.warning(
                        "python_sandbox: no user namespace per call (%s): calls can create "
                        "user namespaces of their own, and the persistent keyring of a uid "
                        "outlives a call and is seen by later calls of that uid",
                        "; ".join(failures) or "no mount namespace here")
                return plan
            failures.append(f"[{', '.join(plan.isolation)}]: {failure}")
        raise ToolError("python_sandbox: no usable isolation; " + "; ".join(failures))

    async def _probe(self, plan: _Plan) -> str | None:
        """Why ``plan`` cannot run the canary (None: it can, and its zygote becomes the
        pool's)."""
        canary = "import datetime, json\nopen('probe', 'w').write('ok')\nprint('ok')\n"
        try:
            zygote = await _Zygote.start(plan)
        except OSError as exc:
            return str(exc)
        try:
            worker = await self._spawn(plan, zygote)
        except (_SpawnError, OSError) as exc:
            await zygote.close()
            return str(exc)
        try:
            output, error = await self._run(worker, canary)
        finally:
            await self._destroy(worker)
        if error is None and output == "ok\n" and zygote.failed is None:
            self._zygote = zygote
            return None
        await zygote.close()
        return f"{error}: {output[-500:]}"


async def _read_some(stream: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(stream.read(8192), 1.0)
    except asyncio.TimeoutError:
        return b""


async def _drain(stream: asyncio.StreamReader, output: _Output) -> None:
    """Read everything (so the writer never blocks) but keep only what ``output`` keeps."""
    while data := await stream.read(1 << 16):
        output.add(data)


def _kill_tree(worker: _Worker) -> int:
    """SIGKILL the worker's process group and every process in its cgroups, until they are
    empty; returns how many processes the memory controller OOM-killed."""
    try:
        os.killpg(worker.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone
    deadline = time.monotonic() + _KILL_TIMEOUT_S
    for group in worker.cgroups:
        _kill_group(group, deadline)
    return sum(_oom_kills(group) for group in worker.cgroups)


def _kill_group(group: Path, deadline: float) -> None:
    """SIGKILL every process in a cgroup until it is empty (or ``deadline``)."""
    while time.monotonic() < deadline:
        try:
            pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        except OSError:
            return  # gone already
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _remove(workdir: Path, cgroups: list[Path]) -> None:
    # With namespaces the call wrote to a tmpfs of its mount namespace, gone with it: the host's
    # directory is empty. Without, its tree (of any depth) is removed by `rm`, which neither
    # recurses on a stack nor follows links out of it.
    try:
        workdir.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(workdir)], check=False,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    with contextlib.suppress(OSError):  # mounted only inside the worker's namespace
        _mount_point(workdir).rmdir()
    for group in cgroups:
        _rmdir_cgroup(group)


def _rmdir_cgroup(group: Path) -> None:
    # Killed tasks may linger in the group for a moment after SIGKILL (EBUSY).
    for _ in range(200):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)
    logger.warning("python_sandbox: could not remove cgroup %s", group)


def _write_cgroup_limits(controller: str, group: Path, limits: SandboxLimits) -> None:
    """The limits of ``controller`` (v1 ``pids`` or ``memory``; ``v2``: both, in the unified
    hierarchy's files) on a worker's group."""
    memory = str(limits.memory_mb << 20)
    if controller in ("pids", V2):
        (group / "pids.max").write_text(str(limits.max_processes))
    if controller == V2:
        (group / "memory.max").write_text(memory)
        swap = group / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")  # without it the limit spills into swap
        return
    if controller == "memory":
        (group / "memory.limit_in_bytes").write_text(memory)
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            try:
                swap.write_text(memory)  # memory + swap: without it the limit spills into swap
            except OSError:
                pass  # swap accounting is off: there is nothing to bound
    (group / "notify_on_release").write_text("0")


def _oom_kills(group: Path) -> int:
    """How many processes the memory controller killed in ``group`` (v1 or v2)."""
    for name in ("memory.oom_control", "memory.events"):
        if (group / name).exists():
            for line in (group / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    return 0


def _usable_cgroups(limits: SandboxLimits) -> list[tuple[str, Path]]:
    """Where worker groups can be created and limited (tried with a probe group): a delegated
    cgroup v2 directory (both controllers), else this process's cgroup v1 ``pids`` and
    ``memory`` directories. Groups a killed sandbox left there are removed first."""
    try:
        memberships = Path("/proc/self/cgroup").read_text()
        mounts = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    v2 = _cgroup_v2_dir(memberships, mounts)
    candidates = ([(V2, delegated)] if v2 is not None
                  and (delegated := _delegated_v2(v2)) is not None else
                  [(controller, parent) for controller in ("pids", "memory")
                   if (parent := _cgroup_v1_dir(controller, memberships, mounts)) is not None])
    usable = []
    for controller, parent in candidates:
        for stale in _stale_groups(parent):
            _kill_group(stale, time.monotonic() + _KILL_TIMEOUT_S)
            _rmdir_cgroup(stale)
        probe = parent / f"{_GROUP_PREFIX}{os.getpid()}.probe"
        try:
            probe.mkdir(exist_ok=True)
            _write_cgroup_limits(controller, probe, limits)
            usable.append((controller, parent))
        except OSError as exc:
            logger.debug("python_sandbox: cgroup %s unusable: %s", controller, exc)
        finally:
            _rmdir_cgroup(probe)
    return usable


def _remove_stale_staging() -> None:
    """Remove the (empty) staging mount points of zygotes whose sandbox process is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{_STAGING_PREFIX}*"):
        owner = path.name[len(_STAGING_PREFIX):].split(".", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            with contextlib.suppress(OSError):  # another sandbox removed it first
                path.rmdir()


def _stale_groups(parent: Path) -> list[Path]:
    """Worker groups under ``parent`` whose sandbox process is gone (killed before it could
    remove them)."""
    stale = []
    for group in parent.glob(f"{_GROUP_PREFIX}*"):
        owner = group.name[len(_GROUP_PREFIX):].split(".", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            stale.append(group)
    return stale


def _cgroup_v1_dir(controller: str, memberships: str, mounts: str) -> Path | None:
    """This process's cgroup directory for a v1 controller (``/proc/self/cgroup`` and
    ``/proc/self/mountinfo`` as text)."""
    own = next((line.split(":", 2)[2] for line in memberships.splitlines()
                if controller in line.split(":", 2)[1].split(",")), None)
    if own is None:
        return None
    for line in mounts.splitlines():
        fields, _, tail = line.partition(" - ")
        fstype, _, options = tail.split(" ")[:3]
        if fstype == "cgroup" and controller in options.split(","):
            root, mount_point = fields.split(" ")[3:5]
            relative = os.path.relpath(own, root)
            if relative.startswith(".."):
                return None
            return Path(mount_point, relative).resolve()
    return None


def _cgroup_v2_dir(memberships: str, mounts: str) -> Path | None:
    """This process's cgroup v2 directory: its ``0::`` membership in the unified hierarchy
    under the ``cgroup2`` mount (None on a v1-only host)."""
    own = next((line[3:] for line in memberships.splitlines() if line.startswith("0::")), None)
    if own is None:
        return None
    for line in mounts.splitlines():
        fields, _, tail = line.partition(" - ")
        if tail.split(" ")[0] == "cgroup2":
            root, mount_point = fields.split(" ")[3:5]
            relative = os.path.relpath(own, root)
            return None if relative.startswith("..") else Path(mount_point, relative).resolve()
    return None


def _delegated_v2(base: Path) -> Path | None:
    """``base`` (this process's v2 group) with the pids and memory controllers enabled for its
    children, or None where that is not allowed. A v2 group that hands controllers down may
    hold no process itself, so when this process is the only one in ``base`` it first moves
    into a leaf of its own (``nemo_orch.main``); processes of others are never moved."""
    try:
        if not set(_V2_CONTROLLERS) <= set((base / "cgroup.controllers").read_text().split()):
            return None
        control = base / "cgroup.subtree_control"
        if set(_V2_CONTROLLERS) <= set(control.read_text().split()):
            return base
        members = (base / "cgroup.procs").read_text().split()
        if any(int(pid) != os.getpid() for pid in members):
            return None
        if members:
            leaf = base / "nemo_orch.main"
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
        control.write_text(" ".join(f"+{name}" for name in _V2_CONTROLLERS))
        return base
    except (OSError, ValueError) as exc:
        logger.debug("python_sandbox: cgroup v2 at %s not delegated: %s", base, exc)
        return None


# pivot_root(2) and keyctl(2) have no libc wrapper: their system call numbers, by machine.
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 271, "s390x": 280}
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# Directories that may be links to their /usr counterparts: the links are kept in the root.
_LIBRARY_DIRS = ("/lib", "/lib64", "/lib32")
# Libraries glibc opens by name at run time, not as anyone's dependency (libgcc_s: unwinding for
# thread cancellation and exit), taken from the C library's directory.
_RUNTIME_LIBRARIES = ("libgcc_s.so.1",)


def _mount_point(workdir: Path) -> Path:
    """Where a worker's private root is mounted, beside its directory (empty on the host)."""
    return workdir.with_name(workdir.name + ".root")


@functools.cache
def _private_root(allowed_packages: tuple[str, ...]) -> PrivateRoot | None:
    """The private root of this interpreter: its executable, standard library and
    ``libpython``, ``allowed_packages`` from its site-packages (top-level names; each one's
    ``<name>.libs`` of bundled libraries too), the shared libraries these load and device
    nodes; None where those libraries cannot be found (no ``ldd``). Resolved once per
    process: the host's libraries do not change under it."""
    ldd = shutil.which("ldd")
    if ldd is None:
        logger.warning("python_sandbox: no `ldd` (glibc's libc-bin) to find the shared "
                       "libraries the interpreter loads: no private root")
        return None
    binds: list[tuple[str, str, bool]] = []
    links: list[tuple[str, str]] = [("/dev/fd", "/proc/self/fd")]
    links += [(directory, os.readlink(directory)) for directory in _LIBRARY_DIRS
              if os.path.islink(directory)]
    executable = os.path.realpath(sys.executable)
    binds.append((executable, executable, False))
    for alias in {sys.executable, getattr(sys, "_base_executable", sys.executable)}:
        if os.path.realpath(alias) == executable and alias != executable:
            links.append((alias, executable))
    stdlib = sysconfig.get_path("stdlib")
    binds.append((stdlib, stdlib, False))
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    libpython = [str(path) for path in sorted(Path(libdir).glob("libpython*"))
                 if not str(path).startswith(stdlib)]
    binds += [(path, path, False) for path in libpython]
    covers = [str(path) for path in [Path(stdlib, "site-packages")] if path.is_dir()]
    # What the dynamic loader maps: the interpreter, libpython, the standard extension modules
    # and every shared object an allowed package ships.
    loaded = [executable, *libpython, *map(str, Path(stdlib, "lib-dynload").glob("*.so"))]
    for name in allowed_packages:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None and not spec.submodule_search_locations:
            raise ToolError(f"python_sandbox: allowed package {name!r} is not installed")
        where = (spec.submodule_search_locations[0] if spec.submodule_search_locations
                 else spec.origin)
        found = [where, f"{where}.libs", str(Path(where).with_name(f"{name}.libs"))]
        for path in dict.fromkeys(found):
            if os.path.exists(path):
                binds.append((path, path, False))
                loaded += _shared_objects(Path(path))
    binds += [(device, device, True) for device in _DEVICES if os.path.exists(device)]
    bound = {target for _, target, _ in binds}
    directories: dict[str, list[tuple[str, str]]] = {}
    for target, source in _shared_libraries(ldd, loaded).items():
        if not any(target == path or target.startswith(path + "/") for path in bound):
            directories.setdefault(os.path.dirname(target), []).append(
                (source, os.path.basename(target)))
    # A directory bound whole would hide what else the root holds under it (the pyenv's lib/
    # holds the standard library): its libraries are bound one by one.
    inside = [*bound, *covers, *(link for link, _ in links), *PrivateRoot.scratch]
    staged = []
    for directory, files in directories.items():
        if any(path.startswith(directory + "/") for path in inside):
            binds += [(source, f"{directory}/{name}", False) for source, name in files]
        else:
            staged.append((directory, tuple(files)))
    return PrivateRoot(tuple(binds), tuple(links), tuple(covers), tuple(staged))


def _shared_objects(path: Path) -> list[str]:
    """The shared objects at or under ``path``."""
    candidates = path.rglob("*.so*") if path.is_dir() else [path]
    return [str(candidate) for candidate in candidates
            if (candidate.name.endswith(".so") or ".so." in candidate.name)
            and candidate.is_file()]


def _shared_libraries(ldd: str, objects: Sequence[str]) -> dict[str, str]:
    """The libraries the dynamic loader maps for ``objects`` (their dependencies, the loader
    itself, and those glibc opens by name at run time), as {path the loader opens: file}:
    the path with its directory resolved (``/lib`` is a link in the private root too), the
    file with every link resolved, so that it can be bound there. ``objects`` are the
    interpreter's and the allowed packages' own, which this process loads anyway: ``ldd``
    may run their loader."""
    # It exits 1 when any one of them is not a dynamic object (e.g. a statically linked one).
    listed = subprocess.run([ldd, *objects], capture_output=True, text=True, timeout=120,
                            check=False, env={"LC_ALL": "C", "PATH": os.defpath}).stdout
    paths = []
    for line in listed.splitlines():
        # "\tlibc.so.6 => /lib/.../libc.so.6 (0x...)", "\t/lib64/ld-linux-x86-64.so.2 (0x...)";
        # not "\tlinux-vdso.so.1 (0x...)", "\tlibfoo.so => not found" or a file's own name.
        if line.startswith("\t"):
            path = line.split(" => ", 1)[-1].strip().split(" (", 1)[0]
            if path.startswith("/"):
                paths.append(path)
    libc = next((path for path in paths if Path(path).name.startswith("libc.so")), None)
    if libc is not None:
        paths += [str(Path(libc).with_name(name)) for name in _RUNTIME_LIBRARIES
                  if Path(libc).with_name(name).is_file()]
    return {os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)):
            os.path.realpath(path) for path in paths if os.path.isfile(path)}


def _hidden_prefixes() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Directories other users cannot search that contain the interpreter's prefixes (e.g. a
    pyenv under /root), each with the prefixes to bind back into its covering tmpfs."""
    hidden: dict[str, set[str]] = {}
    for prefix in {sys.base_prefix, sys.prefix}:
        path = Path(prefix).resolve()
        for ancestor in [*reversed(path.parents), path][1:]:
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                hidden.setdefault(str(ancestor), set()).add(str(path))
                break
    return tuple((directory, tuple(sorted(prefixes))) for directory, prefixes in hidden.items())


@dataclass
class _UidLease:
    """A uid held by one worker on this host (its lock file's ``flock``) until ``release``."""

    uid: int
    fd: int

    def release(self) -> None:
        os.close(self.fd)


def _lease_uid(uid_base: int) -> _UidLease:
    """A uid of ``uid_base + [0, _UID_COUNT)`` no other worker on this host holds, by any
    process (uids are only leased where this process is root)."""
    parent = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    locks = parent / _UID_LOCKS
    with contextlib.suppress(FileExistsError):
        locks.mkdir(mode=0o700)
    info = locks.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise _SpawnError(f"{locks} is not a directory of this user's: cannot lease uids")
    for _ in range(_UID_COUNT):
        uid = uid_base + next(_UID_NEXT) % _UID_COUNT
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return _UidLease(uid, fd)
    raise _SpawnError(f"all {_UID_COUNT} uids from {uid_base} are held by other workers")


def _count_processes(uid: int) -> int:
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        uid_line = next((line for line in text.splitlines() if line.startswith("Uid:")), "")
        count += uid_line.split()[1:2] == [str(uid)]
    return count
