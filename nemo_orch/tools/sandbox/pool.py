"""The pool: ``PythonSandbox``, the isolation it probes and the single-use workers it keeps
forked ahead (the zygote they are forked from: :mod:`.zygote`; a worker's steps on the host:
:mod:`.worker`)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import platform
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_orch.call_kinds import CallKind
from nemo_orch.clients import call_store
from nemo_orch.tools.base import (
    BaseTool,
    Pricing,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    billed_result,
)
from nemo_orch.tools.sandbox import seccomp
from nemo_orch.tools.sandbox.cgroups import _KILL_TIMEOUT_S, _CpuMeter, _usable_cgroups
from nemo_orch.tools.sandbox.identity import _lease_uid, _SpawnError
from nemo_orch.tools.sandbox.limits import SandboxLimits
from nemo_orch.tools.sandbox.plan import ISOLATION_MODES, _Plan
from nemo_orch.tools.sandbox.protocol import _CPU_EXIT, _READY, _call_config, _Output
from nemo_orch.tools.sandbox.root import _PIVOT_ROOT, _hidden_prefixes, _private_root, package_paths
from nemo_orch.tools.sandbox.worker import (
    _drain,
    _kill_tree,
    _prepare,
    _read_some,
    _remove,
    _remove_orphans,
    _Worker,
)
from nemo_orch.tools.sandbox.zygote import _SPAWN_TIMEOUT_S, _Zygote

# What names the sandbox's runs in a call store.
SANDBOX_ENDPOINT = "sandbox://python_sandbox"
logger = logging.getLogger(__name__)

# Comparable to hosted code interpreters: about $0.03 per CPU-hour of a small container plus
# overhead, i.e. ~1e-5 USD/s; 1e-4 USD/s (0.36 USD/hour) deliberately prices a sandbox second
# at roughly one call of a small LLM so the policy learns not to burn time in loops.
SANDBOX_USD_PER_SECOND = 1e-4

# Numbers runs process-wide: several sandboxes in one process name their cgroups apart.
_RUN_NUMBERS = itertools.count()
# Once a call's tree could have used up its CPU budget, its accounting is read this often: the
# tree overshoots by at most this times the cores it may use, plus the kill.
_CPU_POLL_S = 0.05


def default_spec() -> ToolSpec:
    """The spec the policy sees; billed per second of sandbox time (see SANDBOX_USD_PER_SECOND)."""
    return ToolSpec(
        name="python_sandbox",
        description=(
            "Run a Python 3 program in a fresh, isolated process and return what it "
            "printed (stdout and stderr). No network access, no state kept between "
            "calls; print the values you need."
        ),
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "A complete Python program."}},
            "required": ["code"],
        },
        pricing=Pricing(per_second=SANDBOX_USD_PER_SECOND),
        latency_hint_s=0.2,
        timeout_s=30.0,
    )


# Workers forked ahead. A fork spends 10-14 ms entering its cgroups (the kernel's migration
# waits, under cgroup v1 here) besides its own work, so back-to-back calls on two cores drain a
# pool of 2 and wait on a fork (p99 40-84 ms in benchmarks/sandbox.py); 4 keep up (p99 40-45 ms),
# at ~2.6 MB of private memory each.
DEFAULT_POOL_SIZE = 4


class PythonSandbox(BaseTool):
    """Runs ``{"code": str}`` in a pre-started, single-use, contained worker process."""

    def __init__(
        self,
        spec: ToolSpec,
        *,
        timeout_s: float = 10.0,
        cpu_seconds: int = 10,
        memory_mb: int = 1024,
        max_file_mb: int = 16,
        max_processes: int = 32,
        max_output_bytes: int = 16384,
        pool_size: int = DEFAULT_POOL_SIZE,
        isolation: str = "auto",
        uid_base: int = 60000,
        allowed_packages: Sequence[str] = (),
        max_disk_mb: int = 64,
        cpu_cores: float = 1.0,
    ) -> None:
        super().__init__(spec)
        if isolation not in ISOLATION_MODES:
            raise ToolError(f"python_sandbox: isolation must be one of {ISOLATION_MODES}")
        if pool_size < 0:
            raise ToolError("python_sandbox: pool_size must be >= 0")
        self.limits = SandboxLimits(
            timeout_s,
            cpu_seconds,
            memory_mb,
            max_file_mb,
            max_processes,
            max_output_bytes,
            max_disk_mb,
            cpu_cores,
        )
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
        # A run depends on the code and the limits alone (each in a fresh process): a call
        # store records and replays it (calls.*, a journal).
        run = {
            "code": code,
            "limits": dataclasses.asdict(self.limits),
            "packages": list(self.allowed_packages),
        }
        try:
            (output, error), took = await call_store.kept(
                "RUN", SANDBOX_ENDPOINT, run, lambda: self._execute(code), list, tuple
            )
        except (_SpawnError, ToolError) as exc:
            return billed_result(
                self.spec,
                started,
                context,
                error=f"sandbox failed to start: {exc}",
                kind=CallKind.INFRA_ERROR,
            )
        except call_store.StoreMiss as miss:
            return billed_result(
                self.spec, started, context, error=str(miss), kind=CallKind.INFRA_ERROR
            )
        return billed_result(self.spec, started, context, output, error, took=took)

    async def _execute(self, code: str) -> tuple[str, str | None]:
        """``code`` run in a worker of the pool (discarded afterwards): its output and error."""
        worker = await self._acquire()
        try:
            return await self._run(worker, code)
        finally:
            self._background(self._destroy(worker))

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
        lease = (
            None if plan.uid_base is None else await asyncio.to_thread(_lease_uid, plan.uid_base)
        )
        uid = None if lease is None else lease.uid
        try:
            workdir, cgroups = await asyncio.to_thread(_prepare, plan, self.limits, seq, uid)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        worker = None
        try:
            zygote = zygote or await self._zygote_for(plan)
            proc = await zygote.fork(
                _call_config(plan, self.limits, workdir, cgroups, uid, zygote.staging)
            )
            worker = _Worker(
                proc,
                workdir,
                cgroups,
                lease,
                zygote,
                _CpuMeter.of(
                    zip([controller for controller, _ in plan.cgroups], cgroups), self.limits
                ),
            )
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), _SPAWN_TIMEOUT_S)
            except TimeoutError:
                line = b"(no answer within %d s)" % _SPAWN_TIMEOUT_S
            if line != _READY:
                rest = b"" if proc.stdout.at_eof() else await _read_some(proc.stdout)
                raise _SpawnError(
                    (line + rest).decode("utf-8", "replace").strip()[-2000:]
                    or f"exit status {await proc.wait()}"
                )
            return worker
        except BaseException:
            if worker is not None:
                await self._destroy(worker)
            else:
                await asyncio.to_thread(_remove, workdir, cgroups)
                if lease is not None:
                    lease.release()
            raise

    async def _run(self, worker: _Worker, code: str) -> tuple[str, str | None]:
        proc = worker.proc
        output = _Output(self.limits.max_output_bytes)
        reader = asyncio.create_task(_drain(proc.stdout, output))
        timed_out = cpu_spent = False
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                try:
                    proc.stdin.write(code.encode("utf-8", "replace"))
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the worker died first; its exit status says why
                cpu_spent = await self._exit_or_cpu_spent(worker)
        except TimeoutError:
            timed_out = True
            # The budget may have run out since the last look: then that is what stopped it.
            cpu_spent = (
                worker.cpu is not None and self._cpu_used(worker.cpu) >= self.limits.cpu_seconds
            )
        # Whatever it left running (background children) dies now, which closes the pipe.
        oom_kills = await asyncio.to_thread(_kill_tree, worker)
        await proc.wait()
        try:
            await asyncio.wait_for(reader, _KILL_TIMEOUT_S)
        except TimeoutError:
            pass  # an escaped process still holds the pipe; the output so far is what we have
        text = output.text()
        return text, self._error(proc.returncode, timed_out, cpu_spent, oom_kills, text)

    async def _exit_or_cpu_spent(self, worker: _Worker) -> bool:
        """Wait until the worker's process exits (False) or its whole tree, detached processes
        included, has used ``cpu_seconds`` (True). The accounting is read only once the budget
        could be spent at the most cores the tree may use, so short calls never read it."""
        exited, meter = worker.proc.exited, worker.cpu
        if meter is None:  # RLIMIT_CPU per process only
            await worker.proc.wait()
            return False
        budget, used = self.limits.cpu_seconds, 0.0
        while used < budget:
            done, _ = await asyncio.wait(
                [exited], timeout=max((budget - used) / meter.cores, _CPU_POLL_S)
            )
            if done:
                return False
            used = self._cpu_used(meter)
        return True

    @staticmethod
    def _cpu_used(meter: _CpuMeter) -> float:
        """The tree's CPU-seconds (a small read of the cgroup's file); 0 where it cannot be read,
        which leaves the call to its timeout and ``RLIMIT_CPU``."""
        try:
            return meter.seconds()
        except (OSError, ValueError) as exc:
            logger.warning("python_sandbox: cannot read the CPU time of %s: %s", meter.usage, exc)
            return 0.0

    def _error(
        self, returncode: int, timed_out: bool, cpu_spent: bool, oom_kills: int, text: str
    ) -> str | None:
        limits = self.limits
        cpu_limit = f"exceeded the CPU time limit ({limits.cpu_seconds} s)"
        if cpu_spent:  # the tree's budget ran out first, whatever ended it afterwards
            return cpu_limit
        if timed_out:
            return f"timed out after {float(limits.timeout_s)} s"
        if oom_kills or (
            returncode == 1 and text.rstrip().rsplit("\n", 1)[-1].startswith("MemoryError")
        ):
            return f"exceeded the memory limit ({limits.memory_mb} MB)"
        if returncode in (_CPU_EXIT, -signal.SIGXCPU):
            return cpu_limit
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
                await asyncio.to_thread(_remove_orphans)
                self._plan = await self._detect()
                logger.info("python_sandbox isolation: %s", ", ".join(self._plan.isolation))

    async def _detect(self) -> _Plan:
        """Try candidate plans from the strongest down with a canary program; the first that
        runs it correctly is used. ``strict`` accepts only the strongest."""
        if self.isolation_mode == "rlimits":
            return _Plan()
        cgroups = tuple(await asyncio.to_thread(_usable_cgroups, self.limits))
        if not cgroups:
            logger.warning(
                "python_sandbox: no writable cgroup (a delegated v2 subtree or the v1 "
                "pids and memory controllers): per-process limits only"
            )
        root = os.geteuid() == 0
        # Where this process is not root, the zygote needs `unshare` for its user namespace.
        namespaces = root or shutil.which("unshare") is not None
        mounts = _hidden_prefixes() if namespaces else ()
        private = None
        if namespaces and platform.machine() in _PIVOT_ROOT:
            private = await asyncio.to_thread(_private_root, self.allowed_packages)
        uid_base = self.uid_base if root else None
        # Each with a user namespace per call first (where it drops to a uid), then without.
        candidates = (
            [_Plan(namespaces, uid_base, (), cgroups, private, userns) for userns in (root, False)]
            if private
            else []
        )
        if root:
            candidates += [
                _Plan(namespaces, self.uid_base, mounts, cgroups, userns=userns)
                for userns in (namespaces, False)
            ]
            candidates.append(_Plan(False, self.uid_base, (), cgroups))
        candidates += [_Plan(namespaces, None, (), cgroups), _Plan(False, None, (), cgroups)]
        # The allowed packages: bound under the private root's SITE, else where installed.
        site = tuple(
            dict.fromkeys(
                str(Path(paths[0]).parent) for paths in map(package_paths, self.allowed_packages)
            )
        )
        candidates = [
            dataclasses.replace(plan, sys_path=plan.root.sys_path if plan.root else site)
            for plan in candidates
        ]
        # Each first under the system-call filter (a kernel without seccomp refuses it) and with
        # its namespaces owned by a user namespace of the call's (a container may refuse it).
        filtered = (True, False) if seccomp.host_arch() is not None else (False,)
        candidates = [
            dataclasses.replace(plan, seccomp=on, owned_namespaces=owned)
            for plan in candidates
            for on in filtered
            for owned in ((True, False) if plan.namespaces else (False,))
        ]
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
                        "/dev/shm",
                        "; ".join(failures) or "no mount namespace here",
                    )
                if plan.uid_base is not None and not plan.userns:
                    logger.warning(
                        "python_sandbox: no user namespace per call (%s): calls can create "
                        "user namespaces of their own, and the persistent keyring of a uid "
                        "outlives a call and is seen by later calls of that uid",
                        "; ".join(failures) or "no mount namespace here",
                    )
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
