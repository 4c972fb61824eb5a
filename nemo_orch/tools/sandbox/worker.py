"""A pool's single-use worker: its record, its directory and cgroups made and removed, its
process tree killed, its output read; and what killed sandboxes left behind removed.

The pool (:mod:`.pool`) decides when a worker is made, run and destroyed; these are the steps on
the host that each of those takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_orch.tools.sandbox.cgroups import (
    _GROUP_PREFIX,
    _KILL_TIMEOUT_S,
    _CpuMeter,
    _kill_group,
    _oom_kills,
    _orphans,
    _rmdir_cgroup,
    _write_cgroup_limits,
)
from nemo_orch.tools.sandbox.identity import _UidLease
from nemo_orch.tools.sandbox.limits import SandboxLimits
from nemo_orch.tools.sandbox.plan import _Plan
from nemo_orch.tools.sandbox.protocol import _Output
from nemo_orch.tools.sandbox.root import _mount_point
from nemo_orch.tools.sandbox.zygote import _STAGING_PREFIX, _Child, _Zygote

# A worker's directory: <temporary directory>/nemo_orch_sandbox_work.<sandbox pid>.<random>,
# its private root's mount point beside it (root.py).
_WORKDIR_PREFIX = "nemo_orch_sandbox_work."


@dataclass
class _Worker:
    proc: _Child
    workdir: Path
    cgroups: list[Path]
    lease: _UidLease | None
    zygote: _Zygote
    cpu: _CpuMeter | None  # its tree's CPU time, where its cgroups account it

    @property
    def alive(self) -> bool:
        """Neither it nor its zygote (which it dies with) has ended, as far as is known."""
        return self.proc.returncode is None and self.zygote.failed is None


def _prepare(
    plan: _Plan, limits: SandboxLimits, seq: int, uid: int | None
) -> tuple[Path, list[Path]]:
    """Create the worker's directory (owned by its uid) and cgroups (with their limits)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}."))
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
            _write_cgroup_limits(controller, group, limits)
    except OSError:
        _remove(workdir, cgroups)
        raise
    return workdir, cgroups


async def _read_some(stream: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(stream.read(8192), 1.0)
    except TimeoutError:
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


def _remove(workdir: Path, cgroups: list[Path]) -> None:
    # With namespaces the call wrote to a tmpfs of its mount namespace, gone with it: the host's
    # directory is empty. Without, its tree (of any depth) is removed by `rm`, which neither
    # recurses on a stack nor follows links out of it.
    try:
        workdir.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", str(workdir)],
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
    with contextlib.suppress(OSError):  # mounted only inside the worker's namespace
        _mount_point(workdir).rmdir()
    for group in cgroups:
        _rmdir_cgroup(group)


def _remove_orphans() -> None:
    """Remove what sandboxes killed outright (SIGKILL: no ``close``) left in the temporary
    directory: their zygotes' staging mount points and their workers' directories and mount
    points (empty, or with what a call wrote where there was no tmpfs)."""
    temporary = Path(tempfile.gettempdir())
    empty = _orphans(temporary, _STAGING_PREFIX)
    for path in _orphans(temporary, _WORKDIR_PREFIX):
        if path.suffix == ".root":  # a mount point whose directory is gone already
            empty.append(path)
        else:
            _remove(path, [])  # the directory and its mount point
    for path in empty:
        with contextlib.suppress(OSError):  # removed first, by the above or another sandbox
            path.rmdir()
