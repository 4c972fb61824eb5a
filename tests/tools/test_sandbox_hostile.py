"""The python_sandbox tool against hostile programs that try to leave something behind or reach
another call: IPC objects, the host's names, shared uids and keyrings, the disk, deep trees and
nested user namespaces. After each, a benign call on the same pool still answers in time."""

from __future__ import annotations

import asyncio
import ctypes
import errno
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
from nemo_orch.tools.sandbox import PythonSandbox, default_spec, identity
from nemo_orch.tools.sandbox import pool as sandbox_pool

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
    return {kind: Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
            for kind in ("shm", "msg", "sem")}


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
            "    print(sorted(leases))\n")
        other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               check=True, timeout=60)
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
    assert refused == "ENOSPC"  # user.max_user_namespaces is 0 in the call's namespace
    pool.assert_healthy()


def test_the_working_directory_is_bounded_and_leaves_no_disk_used(pool: Pool):
    used = shutil.disk_usage(tempfile.gettempdir()).used
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
    workdir, written, error = result
    assert error == "ENOSPC" and 60 <= written <= 64, result
    pool.settle()
    assert not Path(workdir).exists()
    # Nothing was written to the host's disk (loosely: other processes write too).
    assert shutil.disk_usage(tempfile.gettempdir()).used - used < 32 << 20
    pool.assert_healthy()


def test_a_deep_tree_leaves_nothing_behind(pool: Pool):
    result = pool.call("""
import os
print(os.getcwd())
for _ in range(1500):
    os.mkdir("d")
    os.chdir("d")
open("bottom", "w").write("x" * 1000)
""")
    assert result.error is None, result.output
    workdir = Path(result.output.strip())
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
    sandbox_pool._remove(deep, [])
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
    planted = [Path(tempfile.mkstemp(prefix="nemo_orch_planted_", dir=directory)[1])
               for directory in ["/usr/lib", *libc_dirs[:1]]]
    host_sites = [path for path in [*site.getsitepackages(), "/usr/lib/python3/dist-packages",
                                    "/usr/local/lib/python3/dist-packages"]
                  if os.path.isdir(path)]
    programs = [path for path in [shutil.which(name) for name in ("git", "sh", "ls", "env")]
                if path is not None]
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
    others = [path for path in seen["files"]
              if path != interpreter and ".so" not in os.path.basename(path)]
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
        sandbox = PythonSandbox(default_spec(), pool_size=0, timeout_s=8.0,
                                allowed_packages=["numpy"])
        try:
            return await sandbox.call({"code": (
                "import numpy as np\n"
                "a = np.array([[2.0, 1.0], [1.0, 3.0]])\n"
                "print(np.linalg.solve(a, [3.0, 4.0]).round(6).tolist(), (a @ a).sum())\n")},
                CTX)
        finally:
            await sandbox.close()

    result = asyncio.run(main())
    assert result.error is None, result.output
    assert result.output == "[1.0, 1.0] 25.0\n"
