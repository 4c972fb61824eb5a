"""The python_sandbox tool against hostile programs that try to leave something behind or reach
another call: IPC objects, the host's names, shared uids and keyrings, the disk, deep trees and
nested user namespaces. After each, a benign call on the same pool still answers in time."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import json
import os
import shutil
import site
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_orch.tools.base import ToolContext, ToolResult
from nemo_orch.tools.sandbox import PythonSandbox, default_spec, identity, seccomp
from nemo_orch.tools.sandbox import pool as sandbox_pool
from nemo_orch.tools.sandbox import worker as sandbox_worker
from nemo_orch.tools.sandbox.protocol import WORKDIR

CTX = ToolContext(task_id="t", episode_id="e")
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmat.restype = ctypes.c_void_p
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int]

# The calls' ctypes preamble: libc and the x86_64/aarch64 numbers of the key system calls.
PREAMBLE = """
import ctypes, errno, json, os, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmat.restype = ctypes.c_void_p
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
def fails(result):
    return errno.errorcode[ctypes.get_errno()] if result in (-1, None, 2**64 - 1) else None
"""
KEY = 0x4E454D4F  # the SysV key planted objects use
IPC_CREAT, IPC_RMID = 0o1000, 0


class Pool:
    """One started sandbox for the module, called synchronously, with its usual benign time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sandbox: PythonSandbox) -> None:
        self.loop, self.sandbox = loop, sandbox
        self.usual_s = statistics.median(self.call("print(1)").latency_s for _ in range(5))

    def call(self, code: str) -> ToolResult:
        return self.loop.run_until_complete(self.sandbox.call({"code": code}, CTX))

    def json(self, code: str) -> dict:
        result = self.call(PREAMBLE + code)
        assert result.error is None, result.output
        return json.loads(result.output)

    def settle(self) -> None:
        """Let retired workers be destroyed (their cleanup runs in the background)."""
        self.loop.run_until_complete(asyncio.gather(*list(self.sandbox._tasks)))

    def next_workdir(self) -> Path:
        """The host directory of the worker the next call runs in (the call sees WORKDIR)."""
        self.settle()
        return self.sandbox._idle[0].workdir

    def assert_healthy(self) -> None:
        """A benign call succeeds within 5x its usual time after whatever ran before."""
        result = self.call("print(1)")
        assert result.error is None and result.output == "1\n"
        assert result.latency_s < 5 * self.usual_s, (result.latency_s, self.usual_s)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    loop = asyncio.new_event_loop()
    sandbox = PythonSandbox(default_spec(), timeout_s=5.0, memory_mb=512, max_disk_mb=64)
    loop.run_until_complete(sandbox.start())
    try:
        yield Pool(loop, sandbox)
    finally:
        loop.run_until_complete(sandbox.close())
        loop.close()


def sysv() -> dict[str, list[str]]:
    """The host's SysV IPC objects."""
    return {
        kind: Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        for kind in ("shm", "msg", "sem")
    }


def test_ipc_objects_are_the_calls_own_and_vanish_with_it(pool: Pool):
    assert {"ipcns", "utsns", "cgroupns"} <= set(pool.sandbox.isolation)
    host_segment = libc.shmget(0, 4096, IPC_CREAT | 0o666)  # IPC_PRIVATE
    assert host_segment >= 0
    before = sysv()
    try:
        # The host's segment is tried first: the call's own ids may coincide with it.
        planted = pool.json(f"""
host = fails(libc.shmat({host_segment}, None, 0))
segment = libc.shmget({KEY}, 64 << 20, {IPC_CREAT} | 0o666)
address = libc.shmat(segment, None, 0)
ctypes.memset(address, 7, 64 << 20)  # the memory is really taken
queue = libc.msgget({KEY}, {IPC_CREAT} | 0o666)
message = ctypes.create_string_buffer(b"\\1\\0\\0\\0\\0\\0\\0\\0planted", 16)
sent = libc.msgsnd(queue, message, 8, 0)
semaphores = libc.semget({KEY}, 3, {IPC_CREAT} | 0o666)
mqueue = libc.mq_open(b"/nemo_planted", os.O_CREAT | os.O_RDWR, 0o666, None)
print(json.dumps({{"ids": [segment, queue, semaphores, mqueue], "sent": sent, "host": host,
                   "queues": os.listdir("/dev/mqueue")}}))
""")
        assert min(planted["ids"]) >= 0 and planted["sent"] == 0, planted
        assert planted["queues"] == ["nemo_planted"]
        assert planted["host"] == "EINVAL", "the host's segment is not in the call's namespace"
        seen = pool.json(f"""
print(json.dumps([fails(libc.shmget({KEY}, 0, 0)), fails(libc.msgget({KEY}, 0)),
                  fails(libc.semget({KEY}, 0, 0)),
                  fails(libc.mq_open(b"/nemo_planted", os.O_RDONLY)),
                  os.listdir("/dev/mqueue")]))
""")
        assert seen == ["ENOENT"] * 4 + [[]]
        assert sysv() == before
        assert libc.mq_open(b"/nemo_planted", os.O_RDONLY) == -1
        assert ctypes.get_errno() == errno.ENOENT
    finally:
        libc.shmctl(host_segment, IPC_RMID, None)
    pool.assert_healthy()


def test_hostname_and_cgroup_path_are_the_calls_own(pool: Pool):
    seen = pool.json("""
print(json.dumps([os.uname().nodename, open("/proc/self/cgroup").read().splitlines()]))
""")
    assert seen[0] == "sandbox" != os.uname().nodename
    assert seen[1] and all(line.endswith(":/") for line in seen[1]), seen[1]
    pool.assert_healthy()


def test_uids_are_never_held_by_two_workers_at_once(pool: Pool, monkeypatch):
    # Two pools in this process: their workers' uids are apart.
    async def second_pool() -> set[int]:
        other = PythonSandbox(default_spec(), pool_size=3)
        await other.start()
        try:
            return {worker.lease.uid for worker in other._idle}
        finally:
            await other.close()

    ours = {worker.lease.uid for worker in pool.sandbox._idle}
    theirs = pool.loop.run_until_complete(second_pool())
    assert len(theirs) == 3 and not ours & theirs
    # Across processes: another process leases every uid of a small range but the one held here.
    monkeypatch.setattr(identity, "_UID_COUNT", 4)
    held = identity._lease_uid(90000)
    try:
        script = (
            "from nemo_orch.tools.sandbox import identity\n"
            "identity._UID_COUNT = 4\n"
            "leases = []\n"
            "try:\n"
            "    while True:\n"
            "        leases.append(identity._lease_uid(90000).uid)\n"
            "except identity._SpawnError:\n"
            "    print(sorted(leases))\n"
        )
        other = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
        )
        assert json.loads(other.stdout) == sorted({90000, 90001, 90002, 90003} - {held.uid})
    finally:
        held.release()
    pool.assert_healthy()


def test_a_key_added_in_one_call_is_not_found_by_the_next_of_the_same_uid(monkeypatch):
    monkeypatch.setattr(identity, "_UID_COUNT", 1)  # every worker gets the same uid

    async def main() -> list[ToolResult]:
        sandbox = PythonSandbox(default_spec(), pool_size=0, uid_base=90100)
        await sandbox.start()
        try:
            assert "keyrings" in sandbox.isolation
            add = """
keys = [libc.syscall(ADD_KEY, b"user", b"nemo_planted", b"secret", 6, ctypes.c_long(ring))
        for ring in (-4, -3)]  # the user and the session keyring
print(json.dumps([os.getuid(), keys]))
"""
            search = """
found = [libc.syscall(KEYCTL, 10, ctypes.c_long(ring), b"user", b"nemo_planted", 0)
         for ring in (-4, -3)]  # KEYCTL_SEARCH
print(json.dumps([os.getuid(), found, errno.errorcode[ctypes.get_errno()]]))
"""
            results = []
            for code in (add, search):
                results.append(await sandbox.call({"code": PREAMBLE + code}, CTX))
                await asyncio.gather(*sandbox._tasks)  # the worker is gone: its uid is free
            return results
        finally:
            await sandbox.close()

    added, searched = asyncio.run(main())
    assert added.error is None and searched.error is None, added.output + searched.output
    uid, keys = json.loads(added.output)
    assert uid == 90100 and min(keys) > 0, "the key was added"
    assert json.loads(searched.output) == [90100, [-1, -1], "ENOKEY"]


def test_nested_user_namespaces_are_refused(pool: Pool):
    if "userns" not in pool.sandbox.isolation:
        pytest.skip("no user namespace per call on this host")
    refused = pool.json("print(json.dumps(fails(libc.unshare(0x10000000))))")
    # The system-call filter refuses it first; without it, user.max_user_namespaces is 0 in
    # the call's namespace.
    assert refused == ("EPERM" if "seccomp" in pool.sandbox.isolation else "ENOSPC")
    pool.assert_healthy()


def test_the_working_directory_is_bounded_and_leaves_no_disk_used(pool: Pool):
    used = shutil.disk_usage(tempfile.gettempdir()).used
    workdir = pool.next_workdir()
    result = pool.json("""
written, error = 0, None
try:
    for n in range(14):  # 14 x 15 MB = 210 MB, each file under the file-size limit
        with open(f"f{n}", "wb") as f:
            for _ in range(15):
                f.write(b"x" * (1 << 20))
                written += 1
except OSError as exc:
    error = errno.errorcode[exc.errno]
print(json.dumps([os.getcwd(), written, error]))
""")
    cwd, written, error = result
    assert cwd == WORKDIR and error == "ENOSPC" and 60 <= written <= 64, result
    pool.settle()
    assert not Path(workdir).exists()
    # Nothing was written to the host's disk (loosely: other processes write too).
    assert shutil.disk_usage(tempfile.gettempdir()).used - used < 32 << 20
    pool.assert_healthy()


def test_a_deep_tree_leaves_nothing_behind(pool: Pool):
    workdir = pool.next_workdir()
    result = pool.call("""
import os
for _ in range(1500):
    os.mkdir("d")
    os.chdir("d")
open("bottom", "w").write("x" * 1000)
""")
    assert result.error is None, result.output
    pool.settle()
    assert not workdir.exists() and not workdir.with_name(workdir.name + ".root").exists()
    pool.assert_healthy()


def test_a_tree_on_the_hosts_disk_is_removed_without_recursion(tmp_path):
    # Where there is no mount namespace the directory is the host's: its removal cannot recurse.
    deep = tmp_path / "workdir"
    deep.mkdir()
    fd = os.open(deep, os.O_DIRECTORY)
    for _ in range(1500):  # relative to each level: the whole path is longer than PATH_MAX
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_DIRECTORY, dir_fd=fd), fd
        os.close(parent)
    os.close(os.open("bottom", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    started = time.perf_counter()
    sandbox_worker._remove(deep, [])
    assert not deep.exists() and time.perf_counter() - started < 10


def test_only_what_the_interpreter_loads_is_visible(pool: Pool):
    """Files planted beside the host's libraries, the host's site-packages and its programs
    are not in the call's root: every file there (but /proc, /dev, the standard library and
    the call's own directories), or what a link there names, is the interpreter or a shared
    library it loads."""
    if "private-root" not in pool.sandbox.isolation:
        pytest.skip("no private root here (no mount namespace)")
    pytest.importorskip("yaml")  # on the host, not allowed in the call
    libc_dirs = [path.parent for path in Path("/usr/lib").glob("*/libc.so.6")]
    planted = [
        Path(tempfile.mkstemp(prefix="nemo_orch_planted_", dir=directory)[1])
        for directory in ["/usr/lib", *libc_dirs[:1]]
    ]
    host_sites = [
        path
        for path in [
            *site.getsitepackages(),
            "/usr/lib/python3/dist-packages",
            "/usr/local/lib/python3/dist-packages",
        ]
        if os.path.isdir(path)
    ]
    programs = [
        path
        for path in [shutil.which(name) for name in ("git", "sh", "ls", "env")]
        if path is not None
    ]
    programs += [path for path in ["/usr/lib/git-core/git"] if os.path.exists(path)]
    try:
        for path in planted:
            path.write_text("host data")
            path.chmod(0o644)
        seen = pool.json(f"""
import sys, sysconfig
sys.path += {host_sites!r}
try:
    import yaml
    imported = True
except ImportError:
    imported = False
libc = next(line.split()[-1] for line in open("/proc/self/maps") if "/libc.so" in line)
skip = {{"/proc", "/dev", "/tmp", "/var/tmp", sysconfig.get_path("stdlib"), os.getcwd()}}
files = []
for top, dirs, names in os.walk("/"):
    dirs[:] = [name for name in dirs if os.path.join(top, name) not in skip]
    files += [os.path.realpath(os.path.join(top, name)) for name in names]  # links too
print(json.dumps({{"planted": [os.path.exists(p) for p in {[str(p) for p in planted]!r}],
                  "sites": [os.path.exists(p) for p in {host_sites!r}],
                  "programs": [os.path.exists(p) for p in {programs!r}],
                  "yaml": imported, "files": files,
                  "read_only": [bool(os.statvfs(path).f_flag & os.ST_RDONLY) for path in
                                (libc, os.path.dirname(libc))]}}))
""")
    finally:
        for path in planted:
            path.unlink()
    assert seen["planted"] == [False] * len(planted)
    assert seen["sites"] == [False] * len(host_sites) and not seen["yaml"]
    assert programs and seen["programs"] == [False] * len(programs)
    interpreter = os.path.realpath(sys.executable)
    others = [
        path
        for path in seen["files"]
        if path != interpreter and ".so" not in os.path.basename(path)
    ]
    assert not others, others
    assert 10 < len(seen["files"]) < 200, seen["files"]
    assert seen["read_only"] == [True, True]  # the libraries and their directory
    pool.assert_healthy()


def test_the_standard_librarys_native_modules_load(pool: Pool):
    """Their shared libraries (libssl, libcrypto, libffi, libsqlite3, ...) are in the root."""
    result = pool.call("""
import ctypes, decimal, hashlib, lzma, os, sqlite3, ssl, threading, uuid, zlib
db = sqlite3.connect(":memory:")
thread = threading.Thread(target=lambda: None)
thread.start()
thread.join()
print(hashlib.sha256(b"x").hexdigest()[:8], ssl.OPENSSL_VERSION_NUMBER > 0,
      db.execute("select 6 * 7").fetchone()[0], decimal.Decimal("1.10") + 1,
      ctypes.CDLL("libc.so.6").getpid() == os.getpid(),
      len(zlib.compress(lzma.compress(b"x"))) > 0)
""")
    assert result.error is None, result.output
    assert result.output.split() == ["2d711642", "True", "42", "2.10", "True", "True"]
    pool.assert_healthy()


def test_an_allowed_package_brings_its_libraries():
    """numpy's linear algebra needs its bundled OpenBLAS (numpy.libs) and libgfortran."""
    pytest.importorskip("numpy")

    async def main() -> ToolResult:
        sandbox = PythonSandbox(
            default_spec(), pool_size=0, timeout_s=8.0, allowed_packages=["numpy"]
        )
        try:
            return await sandbox.call(
                {
                    "code": (
                        "import numpy as np\n"
                        "a = np.array([[2.0, 1.0], [1.0, 3.0]])\n"
                        "print(np.linalg.solve(a, [3.0, 4.0]).round(6).tolist(), (a @ a).sum())\n"
                    )
                },
                CTX,
            )
        finally:
            await sandbox.close()

    result = asyncio.run(main())
    assert result.error is None, result.output
    assert result.output == "[1.0, 1.0] 25.0\n"


def cgroup_controllers(isolation: tuple[str, ...]) -> set[str]:
    """The cgroup controllers in force (``cgroup-cpu,cpuacct``: both, mounted together)."""
    return {
        name
        for mechanism in isolation
        if mechanism.startswith("cgroup-")
        for name in mechanism.removeprefix("cgroup-").split(",")
    }


def tree_cpu_seconds(groups: list[Path]) -> float:
    """The CPU-seconds a worker's processes used, the dead included, as its cgroup accounts
    them (v1 ``cpuacct.usage``, v2 ``cpu.stat``)."""
    for group in groups:
        if (group / "cpuacct.usage").exists():
            return int((group / "cpuacct.usage").read_text()) / 1e9
        if (group / "cgroup.controllers").exists():
            stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6
    raise AssertionError(f"no CPU accounting in {groups}")


def metered_call(code: str, monkeypatch, needs: str, **limits) -> tuple[ToolResult, float, float]:
    """``code`` called on a fresh sandbox with ``limits`` (skipped without the cgroup
    controller ``needs``): its result, its wall-clock seconds and its tree's CPU-seconds, read
    once the tree is killed and before its groups are removed. The next call still works."""
    used = []
    kill_tree = sandbox_worker._kill_tree

    def kill_and_measure(worker: sandbox_worker._Worker) -> int:
        oom_kills = kill_tree(worker)
        if not used:  # the call's end (its worker is killed again when destroyed)
            used.append(tree_cpu_seconds(worker.cgroups))
        return oom_kills

    async def main() -> tuple[ToolResult, float, float]:
        sandbox = PythonSandbox(default_spec(), pool_size=0, **limits)
        await sandbox.start()
        try:
            controllers = cgroup_controllers(sandbox.isolation)
            if needs not in controllers and not (needs == "cpuacct" and "v2" in controllers):
                pytest.skip(f"no cgroup {needs} controller here ({sandbox.isolation})")
            # Where the pool calls it (the end of a call and a worker's destruction).
            monkeypatch.setattr(sandbox_pool, "_kill_tree", kill_and_measure)
            started = time.perf_counter()
            result = await sandbox.call({"code": code}, CTX)
            wall_s = time.perf_counter() - started
            after = await sandbox.call({"code": "print(1)"}, CTX)
            assert after.error is None and after.output == "1\n"
            return result, wall_s, used[0]
        finally:
            await sandbox.close()

    return asyncio.run(main())


def test_detached_spinning_processes_share_one_cpu_budget(monkeypatch):
    """Twelve processes, each in a session of its own, spin while the call's first process
    sleeps: RLIMIT_CPU (per process) would let them spend 12 CPU-seconds; the call's cgroup
    accounting stops the whole tree at 1, before its timeout. (The tree's cgroup weighs as
    one process: on a busy host it takes longer to get there.)"""
    code = """
import os, time
for _ in range(12):
    if os.fork() == 0:
        os.setsid()
        while True:
            pass
print("spinning", flush=True)
time.sleep(120)
"""
    result, _, used = metered_call(
        code, monkeypatch, "cpuacct", cpu_seconds=1, timeout_s=60.0, cpu_cores=2
    )
    assert result.error == "exceeded the CPU time limit (1 s)", (result.error, result.output)
    assert result.output == "spinning\n"
    assert 1.0 <= used < 1.3, used


def test_the_cpu_quota_bounds_the_whole_tree(monkeypatch):
    """Two processes spinning for 1.5 s of wall time under ``cpu_cores=0.05``: together at
    most a twentieth of a core over the call (plus the kernel's slack within a period), not
    two. A small quota keeps this telling on a busy host, where the tree gets little more."""
    code = """
import os, time
child = os.fork()
end = time.monotonic() + 1.5
while time.monotonic() < end:
    pass
if child == 0:
    os._exit(0)
os.wait()
"""
    result, wall_s, used = metered_call(
        code, monkeypatch, "cpu", cpu_seconds=5, timeout_s=10.0, cpu_cores=0.05
    )
    assert result.error is None, result.output
    assert 0.0 < used <= 0.05 * wall_s + 0.03, (used, wall_s)


# Round 4: a class of hostile program per mechanism added for it (docs/tools.md, "What a
# sandboxed call can still see or touch").


def test_the_system_call_filter_refuses_what_reaches_outside(pool: Pool):
    """perf events, BPF, userfaultfd, io_uring, file watches, ptrace, mounts, new namespaces,
    vsock, uevent and packet sockets, terminal injection: EPERM, whatever the host's sysctls
    allow; threads and subprocesses still run."""
    arch = seccomp.host_arch()
    if arch is None or "seccomp" not in pool.sandbox.isolation:
        pytest.skip("no system-call filter on this machine")
    refused = pool.json(f"""
import socket, subprocess, sys, threading
NR = {json.dumps(arch.numbers)}
def raw(name, *args):
    return fails(libc.syscall(NR[name], *[ctypes.c_long(a) for a in args])) or "ok"
def sock(*args):
    try:
        socket.socket(*args).close()
        return "ok"
    except OSError as error:
        return errno.errorcode[error.errno]
attr = ctypes.create_string_buffer(128)  # a perf_event_attr of zeros: a valid request
out = {{"perf_event_open": raw("perf_event_open", ctypes.addressof(attr), 0, -1, -1, 0),
       "bpf": raw("bpf", 0, 0, 0), "userfaultfd": raw("userfaultfd", 0),
       "io_uring_setup": raw("io_uring_setup", 1, ctypes.addressof(attr)),
       "inotify_init1": raw("inotify_init1", 0), "fanotify_init": raw("fanotify_init", 0, 0),
       "ptrace": raw("ptrace", 0, 0, 0, 0), "mount": raw("mount", 0, 0, 0, 0, 0),
       "unshare": raw("unshare", 0x40000000), "setns": raw("setns", 0, 0),
       "clone": raw("clone", 0x40000000 | 17, 0, 0, 0, 0), "clone3": raw("clone3", 0, 0),
       "ioctl": raw("ioctl", 0, 0x5412, ctypes.addressof(attr)),
       "vsock": sock(40, socket.SOCK_STREAM), "packet": sock(17, socket.SOCK_RAW),
       "uevent": sock(socket.AF_NETLINK, socket.SOCK_DGRAM, 15),
       "inet": sock(socket.AF_INET, socket.SOCK_STREAM)}}
thread = threading.Thread(target=out.__setitem__, args=("thread", "ok"))
thread.start()
thread.join()
out["subprocess"] = subprocess.run([sys.executable, "-c", "print('ok')"],
                                   capture_output=True, text=True).stdout.strip()
print(json.dumps(out))
""")
    assert refused.pop("clone3") == "ENOSYS"  # the C library falls back to clone
    assert refused.pop("thread") == refused.pop("subprocess") == "ok"
    assert refused == dict.fromkeys(refused, "EPERM")
    pool.assert_healthy()


def test_the_calls_namespaces_belong_to_its_own_user_namespace(pool: Pool):
    """The network namespace (where uevents would arrive), IPC, UTS, mount and PID: each owned
    by a user namespace that is not the host's initial one. (Looked at from the host: the call
    itself, in a user namespace nested in that owner, may not name it.)"""
    if "owned-namespaces" not in pool.sandbox.isolation:
        pytest.skip("no user namespace owns the call's namespaces here")
    pool.settle()
    worker = pool.sandbox._idle[0].proc.pid  # in the call's namespaces, before its call
    owners = {}
    for kind in ("net", "ipc", "uts", "mnt", "pid_for_children"):
        with open(f"/proc/{worker}/ns/{kind}") as ns:
            owner = fcntl.ioctl(ns.fileno(), 0xB701)  # NS_GET_USERNS: a descriptor of its owner
            owners[kind] = os.fstat(owner).st_ino
            os.close(owner)
    assert len(set(owners.values())) == 1, owners  # one user namespace owns them all
    assert os.stat("/proc/self/ns/user").st_ino not in owners.values(), owners
    assert os.stat(f"/proc/{worker}/ns/user").st_ino in owners.values()
    pool.assert_healthy()


def test_the_call_sees_nothing_of_the_hosts_identity(pool: Pool):
    """No host pid, no checkout or virtual environment path, in what a call can read of
    itself: its directory, environment, argv, interpreter, import path, mount table, /tmp."""
    if "private-root" not in pool.sandbox.isolation:
        pytest.skip("no private root: the call works in the host's tree")
    seen = pool.json("""
import sys
mounts = [line.split()[3:5] for line in open("/proc/self/mountinfo")]
argv = open("/proc/self/cmdline", "rb").read().decode().split("\\0")  # [4]: the zygote's code
print(json.dumps({"cwd": os.getcwd(), "env": dict(os.environ),
                  "argv": [arg for index, arg in enumerate(argv) if index != 4],
                  "exe": sys.executable, "path": sys.path, "mounts": mounts,
                  "tmp": os.listdir("/tmp"), "work": os.listdir(".")}))
""")
    assert seen["cwd"] == seen["env"]["HOME"] == WORKDIR and seen["env"]["TMPDIR"] == "/tmp"
    text = json.dumps(seen)
    checkout = str(Path(sandbox_pool.__file__).resolve().parents[3])
    venv = [sys.prefix] if sys.prefix != sys.base_prefix else []
    for host in (checkout, *venv, "nemo_orch_sandbox"):
        assert host not in text, host
    paths = [
        seen["cwd"],
        *seen["env"].values(),
        seen["exe"],
        *seen["path"],
        *[field for mount in seen["mounts"] for field in mount],
        *seen["argv"],
    ]
    assert not [
        path for path in paths if str(os.getpid()) in path.split("/") or f".{os.getpid()}." in path
    ]
    pool.assert_healthy()


def test_no_watch_reaches_the_bound_host_files(pool: Pool):
    """The standard library the call sees is the host's files: a watch on them would report
    the host's reads. Neither inotify nor fanotify can be set up."""
    if "seccomp" not in pool.sandbox.isolation:
        pytest.skip("no system-call filter on this machine")
    watched = pool.json("""
import sysconfig
stdlib = sysconfig.get_path("stdlib").encode()
inotify = libc.inotify_init1(0)
fanotify = libc.fanotify_init(0, 0)
print(json.dumps([fails(inotify), fails(fanotify), os.path.isdir(stdlib)]))
""")
    assert watched == ["EPERM", "EPERM", True]
    pool.assert_healthy()
