"""The python_sandbox tool: normal code works, hostile code is contained with a clear error, the
host is unaffected, and the next call still works."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nemo_orch.tools.base import ToolContext, ToolError, ToolResult, Usage
from nemo_orch.tools.sandbox import V2, PythonSandbox, SandboxLimits, default_spec, zygote
from nemo_orch.tools.sandbox.cgroups import (
    _cgroup_v1_dir,
    _cgroup_v1_dirs,
    _cgroup_v2_dir,
    _CpuMeter,
    _delegated_v2,
    _oom_kills,
    _v2_controllers,
    _write_cgroup_limits,
)

CTX = ToolContext(task_id="t", episode_id="e")


def run(
    codes: list[str], concurrent: bool = False, context: ToolContext = CTX, **options
) -> tuple[list[ToolResult], tuple]:
    """Start a sandbox, run ``codes`` (then ``print(1)`` to show the next call works), close it."""
    options = {"timeout_s": 2.0, "memory_mb": 256, **options}

    async def main() -> tuple[list[ToolResult], tuple]:
        sandbox = PythonSandbox(default_spec(), **options)
        await sandbox.start()
        try:
            calls = [sandbox.call({"code": code}, context) for code in codes]
            if concurrent:
                results = list(await asyncio.gather(*calls))
            else:
                results = [await call for call in calls]
            results.append(await sandbox.call({"code": "print(1)"}, CTX))
        finally:
            await sandbox.close()
        return results, sandbox.isolation

    results, isolation = asyncio.run(main())
    assert results[-1].error is None and results[-1].output == "1\n", "the next call must work"
    return results[:-1], isolation


def children() -> list[int]:
    """Live (non-zombie) processes whose parent is this test process."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line
            )
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(os.getpid()) and not fields.get(
            "State", ""
        ).startswith("Z"):
            found.append(int(status.parent.name))
    return found


def test_print_and_accounting():
    (result,), isolation = run(["print(1 + 1)"])
    assert result.error is None and result.output == "2\n"
    assert result.latency_s > 0
    assert result.cost_usd == pytest.approx(default_spec().pricing.per_second * result.latency_s)
    assert "rlimits" in isolation


def test_modeled_time_bills_the_declared_latency_not_the_clock():
    spec = default_spec()
    modeled = dataclasses.replace(CTX, modeled_time=True)
    results, _ = run(["print(1)", "import time; time.sleep(0.3); print(2)"], context=modeled)
    for result in results:
        assert result.error is None
        assert result.latency_s == spec.latency_hint_s
        assert result.cost_usd == spec.pricing.cost(Usage(), spec.latency_hint_s)


def test_syntax_error_and_exception_show_their_message():
    (syntax, raised), _ = run(["print(", "def f():\n    return 1 / 0\nf()\n"])
    assert syntax.error == "exit status 1" and "SyntaxError" in syntax.output
    assert raised.error == "exit status 1"
    assert "ZeroDivisionError" in raised.output and "return 1 / 0" in raised.output
    assert "Traceback" in raised.output and "exec(" not in raised.output  # no bootstrap frames


def test_bad_arguments_are_an_error():
    async def main() -> ToolResult:
        sandbox = PythonSandbox(default_spec(), pool_size=0, isolation="rlimits")
        return await sandbox.call({"code": 1}, CTX)

    assert "must be a string" in asyncio.run(main()).error


def test_infinite_loop_times_out():
    (result,), _ = run(["print('started')\nwhile True: pass"])
    assert result.error == "timed out after 2.0 s"
    assert result.output == "started\n"  # output before the timeout is kept (unbuffered)


def test_cpu_limit():
    (result,), _ = run(["while True: pass"], timeout_s=6.0, cpu_seconds=1)
    assert result.error == "exceeded the CPU time limit (1 s)"


def test_fork_bomb_is_contained():
    before = children()
    (result,), _ = run(["import os\nwhile True:\n    os.fork()\n"])
    assert result.error is not None
    assert children() == before


def test_huge_allocations_hit_the_memory_limit():
    (big, growing), _ = run(
        ["x = bytearray(10**11)", "x = []\nwhile True:\n    x.append(bytearray(10**6))\n"]
    )
    assert big.error == "exceeded the memory limit (256 MB)" and "MemoryError" in big.output
    assert growing.error == "exceeded the memory limit (256 MB)"


def test_memory_limit_covers_the_process_tree():
    """Children each under RLIMIT_AS but together over the limit: the memory cgroup stops them."""
    code = (
        "import os, time\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        x = b'x' * (200 * 2**20)\n"  # touched pages, unlike bytearray(n)
        "        time.sleep(1)\n"
        "        os._exit(0)\n"
        "os.wait(); os.wait(); os.wait(); os.wait()\n"
    )
    (result,), isolation = run([code], timeout_s=4.0)
    if "cgroup-memory" not in isolation:
        pytest.skip("no memory cgroup here")
    assert result.error == "exceeded the memory limit (256 MB)"


def test_cannot_write_outside_its_directory():
    targets = [Path("/etc/nemo_orch_pwned"), Path(__file__).with_name("nemo_orch_pwned")]
    code = "\n".join(f"open({str(t)!r}, 'w').write('x')" for t in targets)
    (first, second, own), isolation = run(
        [
            code,
            f"open({str(targets[1])!r}, 'w').write('x')",
            "open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())",
        ]
    )
    if "uid" not in isolation:
        pytest.skip("running as root without a uid drop: files cannot be protected")
    for result in (first, second):  # refused, or not there at all in a private root
        assert result.error == "exit status 1" and any(
            kind in result.output for kind in ("PermissionError", "FileNotFoundError")
        )
    assert not any(t.exists() for t in targets)
    assert own.error is None and own.output == "ok\n"  # its own directory is writable


def test_the_host_is_invisible_and_untouched_in_the_private_root():
    """World-readable files in the host's /tmp, in a directory beside the repository and in
    the repository itself cannot be read; what the call writes to /tmp, /var/tmp and /dev/shm
    stays out of the host's; its own directory, the standard library and subprocesses work."""
    repository = Path(__file__).resolve().parents[2]
    beside = Path(tempfile.mkdtemp(prefix="nemo_orch_planted_", dir=repository.parent))
    planted = [
        Path(tempfile.mkstemp(prefix="nemo_orch_planted_", dir="/tmp")[1]),
        beside / "dataset.txt",
        repository / "README.md",
    ]
    try:
        for path in planted[:2]:
            path.write_text("host data")
            path.chmod(0o644)
        beside.chmod(0o755)
        mark = f"nemo_orch_left_{os.getpid()}"
        code = "\n".join(
            [
                "import os, subprocess, sys",
                *[f"print(os.path.exists({str(path)!r}))" for path in planted],
                *[
                    f"open('{directory}/{mark}', 'w').write('x')"
                    for directory in ("/tmp", "/var/tmp", "/dev/shm")
                ],
                "open('own.txt', 'w').write('ok')",
                "print(open('own.txt').read())",
                "print(subprocess.run([sys.executable, '-c', 'import json; print(json.dumps(1))'],"
                " capture_output=True, text=True).stdout.strip())",
            ]
        )
        (result,), isolation = run([code], timeout_s=8.0)
        if "private-root" not in isolation:
            pytest.skip("no private root here (no mount namespace)")
        assert result.error is None, result.output
        assert result.output.split() == ["False", "False", "False", "ok", "1"]
        assert not any(
            Path(directory, mark).exists() for directory in ("/tmp", "/var/tmp", "/dev/shm")
        )
    finally:
        planted[0].unlink(missing_ok=True)
        shutil.rmtree(beside, ignore_errors=True)


def test_packages_are_visible_only_when_allowed():
    code = "import numpy\nprint(numpy.arange(4).sum())"
    (denied,), isolation = run([code], timeout_s=8.0)
    if "private-root" not in isolation:
        pytest.skip("no private root here (no mount namespace)")
    assert denied.error == "exit status 1" and "ModuleNotFoundError" in denied.output
    (allowed,), _ = run([code], timeout_s=8.0, allowed_packages=["numpy"])
    assert allowed.error is None and allowed.output == "6\n"
    with pytest.raises(ToolError, match="allowed package 'no_such_package' is not installed"):
        run(["print(1)"], allowed_packages=["no_such_package"])


def test_strict_never_falls_back():
    """``strict`` runs with the strongest isolation or refuses to start, never weaker."""
    try:
        (result,), isolation = run(["print('strict')"], isolation="strict")
    except ToolError as error:
        assert "no usable isolation" in str(error)
        return
    assert result.output == "strict\n"
    assert {"private-root", "netns", "pidns"} <= set(isolation)


def test_no_network():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        (result,), isolation = run(
            [f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"]
        )
    finally:
        listener.close()
    if "netns" not in isolation:
        pytest.skip("no network namespace here")
    # No socket to try with under the system-call filter, else no route.
    assert (
        result.error == "exit status 1"
        and ("PermissionError" if "seccomp" in isolation else "OSError") in result.output
    )


def test_parent_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("NEMO_ORCH_TEST_SECRET", "s3cret")
    code = (
        "import os\nprint(dict(os.environ))\n"
        f"try:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
        "except OSError as exc:\n    print(type(exc).__name__)\n"
    )
    (result,), _ = run([code])
    assert result.error is None
    assert "s3cret" not in result.output and "NEMO_ORCH_TEST_SECRET" not in result.output


def test_huge_output_is_truncated():
    (result,), _ = run(
        ["print('x' * 100_000_000)\nraise ValueError('at the end')"],
        max_output_bytes=1000,
        timeout_s=8.0,
    )
    assert result.error == "exit status 1"
    assert result.output.startswith("x" * 1000 + "\n[output truncated after 1000 bytes")
    assert "ValueError: at the end" in result.output  # the tail stays visible
    assert len(result.output) < 4000


def test_concurrent_calls_beyond_the_pool():
    codes = [f"import time\ntime.sleep(0.3)\nprint({i})" for i in range(4)]
    results, _ = run(codes, concurrent=True, pool_size=2)
    assert [(r.error, r.output) for r in results] == [(None, f"{i}\n") for i in range(4)]


def test_close_leaves_no_processes_cgroups_or_directories():
    before = children()

    async def main() -> PythonSandbox:
        sandbox = PythonSandbox(default_spec(), pool_size=3, timeout_s=2.0)
        await sandbox.start()
        await asyncio.gather(
            *(sandbox.call({"code": "import os; os.system('sleep 30 &')"}, CTX) for _ in range(2))
        )
        workdirs = [w.workdir for w in sandbox._idle]
        await sandbox.close()
        assert not any(path.exists() for path in workdirs)
        return sandbox

    sandbox = asyncio.run(main())
    assert children() == before
    for parent in sandbox.cgroup_parents:
        assert not list(parent.glob(f"nemo_orch_sandbox.{os.getpid()}.*"))


def test_rlimits_only_fallback():
    (ok, loop), isolation = run(["print('fallback')", "while True: pass"], isolation="rlimits")
    assert isolation == ("rlimits", "no-new-privs")
    assert ok.error is None and ok.output == "fallback\n"
    assert loop.error == "timed out after 2.0 s"


def test_cgroup_v2_is_found_delegated_and_limited(tmp_path):
    """The v2 path on a tree laid out as the kernel does (this host is v1): the unified
    hierarchy found from /proc, the controllers handed down after this process moves into a
    leaf of its own (never when others share its group), the limits written, the OOM kills and
    CPU time read."""
    mounts = (
        "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        "31 23 0:28 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
    )
    assert _cgroup_v2_dir("0::/user.slice/job\n", mounts) == Path("/sys/fs/cgroup/user.slice/job")
    assert _cgroup_v2_dir("8:pids:/\n1:name=systemd:/\n", mounts) is None  # v1 only
    assert _cgroup_v1_dir("pids", "8:pids:/a\n", mounts) == Path("/sys/fs/cgroup/pids/a")

    base = tmp_path / "job"
    base.mkdir()
    (base / "cgroup.controllers").write_text("cpu io memory pids\n")
    (base / "cgroup.subtree_control").write_text("\n")
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n1234567\n")
    assert _delegated_v2(base) is None  # another process lives there: nothing is moved
    assert not (base / "nemo_orch.main").exists()
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n")
    assert _delegated_v2(base) == base
    assert (base / "nemo_orch.main" / "cgroup.procs").read_text() == str(os.getpid())
    assert set((base / "cgroup.subtree_control").read_text().split()) == {
        "+pids",
        "+memory",
        "+cpu",
    }
    (base / "cgroup.subtree_control").write_text("pids memory cpu\n")
    assert _v2_controllers(base) == ["pids", "memory", "cpu"]
    (base / "cgroup.controllers").write_text("io memory pids\n")
    (base / "cgroup.subtree_control").write_text("\n")
    assert _delegated_v2(base) == base  # no cpu to hand down: pids and memory still bound
    assert (base / "cgroup.subtree_control").read_text() == "+pids +memory"
    (base / "cgroup.controllers").write_text("io cpu pids\n")
    assert _delegated_v2(base) is None  # the controllers are not there to hand down

    group = tmp_path / "group"
    group.mkdir()
    (group / "memory.swap.max").write_text("max\n")
    limits = SandboxLimits(memory_mb=64, max_processes=8, cpu_cores=1.5)
    _write_cgroup_limits(V2, group, limits)
    assert not (group / "cpu.max").exists()  # no cpu controller delegated: nothing to bound
    (group / "cpu.max").write_text("max 100000\n")
    _write_cgroup_limits(V2, group, limits)
    assert [
        (group / name).read_text()
        for name in ("pids.max", "memory.max", "memory.swap.max", "cpu.max")
    ] == ["8", str(64 << 20), "0", "150000 100000"]
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert _oom_kills(group) == 2
    (group / "cpu.stat").write_text(
        "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 30\n"
    )
    meter = _CpuMeter.of([(V2, group)], limits)
    assert meter.seconds() == 2.5 and meter.cores == min(os.cpu_count(), 1.5)


def test_cgroup_v1_cpu_quota_and_accounting(tmp_path):
    """The v1 path: cpu and cpuacct in hierarchies of their own (as on this host) or mounted
    together (one group takes both), the quota written and the tree's CPU time read. (The
    mounts are under /cg, which no host has, as resolving the paths would follow links.)"""
    apart = (
        "32 31 0:29 / /cg/cpu rw - cgroup cgroup rw,cpu\n"
        "33 31 0:30 / /cg/cpuacct rw - cgroup cgroup rw,cpuacct\n"
        "39 31 0:36 / /cg/pids rw - cgroup cgroup rw,pids\n"
    )
    assert _cgroup_v1_dirs("8:pids:/\n2:cpuacct:/a\n1:cpu:/a\n", apart) == [
        ("pids", Path("/cg/pids")),
        ("cpu", Path("/cg/cpu/a")),
        ("cpuacct", Path("/cg/cpuacct/a")),
    ]
    together = "32 31 0:29 / /cg/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    assert _cgroup_v1_dirs("4:cpu,cpuacct:/a\n", together) == [
        ("cpu,cpuacct", Path("/cg/cpu,cpuacct/a"))
    ]

    limits = SandboxLimits(cpu_cores=0.5)
    cpu, cpuacct = tmp_path / "cpu", tmp_path / "cpuacct"
    for group in (cpu, cpuacct):
        group.mkdir()
        _write_cgroup_limits(group.name, group, limits)
    assert [(cpu / name).read_text() for name in ("cpu.cfs_period_us", "cpu.cfs_quota_us")] == [
        "100000",
        "50000",
    ]
    assert sorted(path.name for path in cpuacct.iterdir()) == ["notify_on_release"]
    (cpuacct / "cpuacct.usage").write_text("1500000000\n")
    meter = _CpuMeter.of([("cpu", cpu), ("cpuacct", cpuacct)], limits)
    assert meter.usage == cpuacct / "cpuacct.usage" and meter.cores == 0.5
    assert meter.seconds() == 1.5
    # Accounting without a quota: the tree may use every core; without accounting, no meter.
    assert _CpuMeter.of([("cpuacct", cpuacct)], limits).cores == os.cpu_count()
    assert _CpuMeter.of([("cpu", cpu), ("pids", tmp_path)], limits) is None

    both = tmp_path / "both"
    both.mkdir()
    _write_cgroup_limits("cpu,cpuacct", both, SandboxLimits(cpu_cores=1e-6))
    assert (both / "cpu.cfs_quota_us").read_text() == "1000"  # the kernel's smallest quota
    assert _CpuMeter.of([("cpu,cpuacct", both)], limits).usage == both / "cpuacct.usage"
    with pytest.raises(ToolError, match="cpu_cores must be > 0"):
        SandboxLimits(cpu_cores=0)


def test_groups_a_killed_sandbox_left_are_removed_at_the_next_start():
    async def parents() -> tuple[Path, ...]:
        sandbox = PythonSandbox(default_spec(), pool_size=0)
        await sandbox.start()
        await sandbox.close()
        return sandbox.cgroup_parents

    found = asyncio.run(parents())
    if not found:
        pytest.skip("no writable cgroup here")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a sandbox process that is no more
    stale = [parent / f"nemo_orch_sandbox.{gone.pid}.7" for parent in found]
    for group in stale:
        group.mkdir()
    assert asyncio.run(parents()) == found
    assert not any(group.exists() for group in stale)


def test_an_interpreter_living_under_tmp_runs_in_the_private_root(tmp_path):
    """A checkout (and its .venv) under the host's /tmp, as CI's may be: the private root's own
    /tmp still holds the interpreter's path, so subprocesses of ``sys.executable`` run."""
    import sys
    import venv

    venv.create(tmp_path / "venv", with_pip=False, symlinks=True)
    program = (
        "import asyncio, json, sys\n"
        "from nemo_orch.tools.base import ToolContext\n"
        "from nemo_orch.tools.sandbox import PythonSandbox, default_spec\n"
        "async def main():\n"
        "    sandbox = PythonSandbox(default_spec(), pool_size=0)\n"
        "    await sandbox.start()\n"
        "    code = ('import subprocess, sys; print(subprocess.run([sys.executable, '\n"
        '            \'"-c", "print(7)"], capture_output=True, text=True).stdout)\')\n'
        "    result = await sandbox.call({'code': code}, ToolContext())\n"
        "    await sandbox.close()\n"
        "    print(json.dumps([sandbox.isolation, result.output, result.error]))\n"
        "asyncio.run(main())\n"
    )
    paths = [str(Path(__file__).resolve().parents[2]), *sys.path[1:]]
    completed = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "python"), "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )
    isolation, output, error = json.loads(completed.stdout.splitlines()[-1])
    if "private-root" not in isolation:
        pytest.skip("no private root here (no mount namespace)")
    assert (output, error) == ("7\n\n", None)


def test_each_forked_call_starts_clean_and_exits_as_a_program_does():
    """Calls are forked from one zygote: what a call changes in the modules it was forked with,
    in its /tmp or its PID namespace never reaches the next; its exit behaves as an
    interpreter's (threads joined, atexit run, sys.exit codes and messages)."""
    (tamper, clean, pids, threads, exit_code, exit_message), isolation = run(
        [
            "import json, math\nmath.pi = 3\njson.dumps = None\nopen('/tmp/left', 'w').write('x')\n"
            "import os\nprint(os.getpid())",
            "import json, math, os\nprint(math.pi, json.dumps([1]), os.path.exists('/tmp/left'))",
            "import os\nprint(os.getpid())",
            "import atexit, threading, time\natexit.register(print, 'atexit ran')\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
            "print('main done')",
            "import sys\nsys.exit(3)",
            "import sys\nsys.exit('giving up')",
        ]
    )
    assert clean.error is None and clean.output == "3.141592653589793 [1] False\n"
    if "pidns" in isolation:
        assert tamper.output == pids.output == "1\n"  # each call is its namespace's first
    assert threads.output == "main done\nthread done\natexit ran\n"
    assert exit_code.error == "exit status 3"
    assert exit_message.error == "exit status 1" and exit_message.output == "giving up\n"


def test_a_zygote_in_doubt_is_replaced(monkeypatch):
    """The zygote killed, or stopped so that a fork request gets no answer: the children it
    forked die with it and the next calls run on a new one."""
    monkeypatch.setattr(zygote, "_SPAWN_TIMEOUT_S", 1.0)

    async def main() -> list[ToolResult]:
        sandbox = PythonSandbox(default_spec(), pool_size=2, timeout_s=2.0)
        await sandbox.start()
        results = []
        try:
            for how in (signal.SIGKILL, signal.SIGSTOP):
                while len(sandbox._idle) < sandbox.pool_size or sandbox._tasks:
                    await asyncio.sleep(0.01)  # the pool is full again
                zygote = sandbox._zygote
                zygote.proc.send_signal(how)
                if how == signal.SIGSTOP:  # a worker forked before still runs a call...
                    results.append(await sandbox.call({"code": "print('after')"}, CTX))
                idle = list(sandbox._idle)
                # ...while the refill's request goes unanswered (or the zygote is gone)
                await asyncio.wait_for(zygote.proc.wait(), 5)
                await asyncio.sleep(0.1)
                assert zygote.failed is not None
                # The workers it forked died with it.
                assert [await asyncio.wait_for(w.proc.wait(), 5) for w in idle] == [-9] * len(idle)
                results += [await sandbox.call({"code": "print('after')"}, CTX) for _ in range(3)]
                assert sandbox._zygote is not zygote and sandbox._zygote.failed is None
        finally:
            await sandbox.close()
        return results

    assert [(r.error, r.output) for r in asyncio.run(main())] == [(None, "after\n")] * 7


def test_the_zygote_and_its_workers_die_with_the_process_that_owns_them():
    """A trainer killed outright (SIGKILL: no close) leaves no zygote or worker behind, and the
    next sandbox to start removes the directories its workers had."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import asyncio, os\n"
            "from nemo_orch.tools.sandbox import PythonSandbox, default_spec\n"
            "async def main():\n"
            "    sandbox = PythonSandbox(default_spec(), pool_size=2)\n"
            "    await sandbox.start()\n"
            "    print(sandbox._zygote.proc.pid, *[w.proc.pid for w in sandbox._idle], flush=True)\n"
            "    print(*[w.workdir for w in sandbox._idle], flush=True)\n"
            "    await asyncio.sleep(60)\n"
            "asyncio.run(main())\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(pid) for pid in owner.stdout.readline().split()]
    workdirs = [Path(path) for path in owner.stdout.readline().split()]
    assert len(pids) == 3 and all(Path(f"/proc/{pid}").exists() for pid in pids)
    assert len(workdirs) == 2 and all(path.exists() for path in workdirs)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert any(path.exists() for path in workdirs)  # no close ran: the next start cleans up
    assert run(["print(2)"])[0][0].output == "2\n"
    left = [p for w in workdirs for p in (w, w.with_name(w.name + ".root")) if p.exists()]
    assert left == []
