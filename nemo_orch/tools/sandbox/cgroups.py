"""A worker's cgroups: where they can be made (v2 delegated or v1), their limits, their CPU
accounting, killing their processes and removing them."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nemo_orch.tools.sandbox.limits import SandboxLimits

logger = logging.getLogger(__name__)

_KILL_TIMEOUT_S = 5.0
# Worker groups are <parent>/nemo_orch_sandbox.<sandbox pid>.<run number>; V2 stands for the
# unified hierarchy's group, which takes _V2_CONTROLLERS and what it offers of _V2_OPTIONAL. Under v1 each controller is a
# hierarchy of its own, or several share one ("cpu,cpuacct" where they are mounted together).
_GROUP_PREFIX = "nemo_orch_sandbox."
V2 = "v2"
_V2_CONTROLLERS = ("pids", "memory")
_V2_OPTIONAL = ("cpu",)  # enabled too where the group offers it
_V1_CONTROLLERS = ("pids", "memory", "cpu", "cpuacct")
# The CFS period of the cpu quota (the kernel's default) and the smallest quota it takes.
_CPU_PERIOD_US = 100_000
_MIN_CPU_QUOTA_US = 1_000


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
    """The limits of ``controller`` on a worker's group: v1 ``pids``, ``memory``, ``cpu`` (the
    quota), ``cpuacct`` (accounting only, nothing to limit) or co-mounted ones joined by commas;
    ``v2``: all of ``_V2_CONTROLLERS``, in the unified hierarchy's files."""
    memory = str(limits.memory_mb << 20)
    quota = max(_MIN_CPU_QUOTA_US, round(limits.cpu_cores * _CPU_PERIOD_US))
    names = controller.split(",")
    if controller == V2 or "pids" in names:
        (group / "pids.max").write_text(str(limits.max_processes))
    if controller == V2:
        (group / "memory.max").write_text(memory)
        swap = group / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")  # without it the limit spills into swap
        if (group / "cpu.max").exists():  # the cpu controller is delegated
            (group / "cpu.max").write_text(f"{quota} {_CPU_PERIOD_US}")
        return
    if "cpu" in names:
        (group / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    if "memory" in names:
        (group / "memory.limit_in_bytes").write_text(memory)
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            try:
                swap.write_text(memory)  # memory + swap: without it the limit spills into swap
            except OSError:
                pass  # swap accounting is off: there is nothing to bound
    (group / "notify_on_release").write_text("0")


@dataclass(frozen=True)
class _CpuMeter:
    """A worker tree's CPU time, from its group's accounting file (v1 ``cpuacct.usage``, in
    nanoseconds, or v2 ``cpu.stat``), and how many cores it can use at most (its quota, or the
    host's cores where no cpu controller bounds it)."""

    usage: Path
    cores: float

    @classmethod
    def of(cls, groups: Iterable[tuple[str, Path]], limits: SandboxLimits) -> _CpuMeter | None:
        """The meter of a worker's groups (``(controller, group)`` pairs); None without
        accounting."""
        groups = [(controller.split(","), group) for controller, group in groups]
        cores = float(os.cpu_count() or 1)
        if any(
            "cpu" in names or names == [V2] and (group / "cpu.max").exists()
            for names, group in groups
        ):
            cores = min(cores, limits.cpu_cores)
        for names, group in groups:
            if names == [V2]:
                return cls(group / "cpu.stat", cores)
            if "cpuacct" in names:
                return cls(group / "cpuacct.usage", cores)
        return None

    def seconds(self) -> float:
        """The CPU-seconds the group's processes used so far (those gone included)."""
        text = self.usage.read_text()
        if self.usage.name == "cpuacct.usage":
            return int(text) / 1e9
        for line in text.splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
        raise ValueError(f"no usage_usec in {self.usage}")


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
    cgroup v2 directory (all of ``_V2_CONTROLLERS``), else this process's cgroup v1 directories
    of ``_V1_CONTROLLERS`` (controllers mounted together share one, named ``cpu,cpuacct``).
    Groups a killed sandbox left there are removed first."""
    try:
        memberships = Path("/proc/self/cgroup").read_text()
        mounts = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    v2 = _cgroup_v2_dir(memberships, mounts)
    candidates = (
        [(V2, delegated)]
        if v2 is not None and (delegated := _delegated_v2(v2)) is not None
        else _cgroup_v1_dirs(memberships, mounts)
    )
    usable = []
    for controller, parent in candidates:
        for stale in _orphans(parent, _GROUP_PREFIX):
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


def _orphans(parent: Path, prefix: str) -> list[Path]:
    """The entries ``<prefix><sandbox pid>.<...>`` under ``parent`` whose sandbox process is
    gone (killed before it could remove them: worker cgroups, directories, mount points)."""
    orphans = []
    for path in parent.glob(f"{prefix}*"):
        owner = path.name[len(prefix) :].split(".", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            orphans.append(path)
    return orphans


def _cgroup_v1_dir(controller: str, memberships: str, mounts: str) -> Path | None:
    """This process's cgroup directory for a v1 controller (``/proc/self/cgroup`` and
    ``/proc/self/mountinfo`` as text)."""
    own = next(
        (
            line.split(":", 2)[2]
            for line in memberships.splitlines()
            if controller in line.split(":", 2)[1].split(",")
        ),
        None,
    )
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


def _cgroup_v1_dirs(memberships: str, mounts: str) -> list[tuple[str, Path]]:
    """This process's directories of ``_V1_CONTROLLERS``, each with its controllers: those
    mounted together share a directory, and a worker one group there (``cpu,cpuacct``)."""
    controllers: dict[Path, list[str]] = {}
    for controller in _V1_CONTROLLERS:
        if (parent := _cgroup_v1_dir(controller, memberships, mounts)) is not None:
            controllers.setdefault(parent, []).append(controller)
    return [(",".join(names), parent) for parent, names in controllers.items()]


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
    """``base`` (this process's v2 group) with ``_V2_CONTROLLERS`` (and what it offers of
    ``_V2_OPTIONAL``) enabled for its children, or None where that is not allowed. A v2 group
    that hands controllers down may hold no process itself, so when this process is the only
    one in ``base`` it first moves into a leaf of its own (``nemo_orch.main``); processes of
    others are never moved."""
    try:
        offered = set((base / "cgroup.controllers").read_text().split())
        if not set(_V2_CONTROLLERS) <= offered:
            return None
        wanted = [*_V2_CONTROLLERS, *(name for name in _V2_OPTIONAL if name in offered)]
        control = base / "cgroup.subtree_control"
        if set(wanted) <= set(control.read_text().split()):
            return base
        members = (base / "cgroup.procs").read_text().split()
        if any(int(pid) != os.getpid() for pid in members):
            return None
        if members:
            leaf = base / "nemo_orch.main"
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
        control.write_text(" ".join(f"+{name}" for name in wanted))
        return base
    except (OSError, ValueError) as exc:
        logger.debug("python_sandbox: cgroup v2 at %s not delegated: %s", base, exc)
        return None


def _v2_controllers(base: Path) -> list[str]:
    """The controllers ``base`` hands down to its children (the workers' groups)."""
    try:
        enabled = set((base / "cgroup.subtree_control").read_text().split())
    except OSError:
        return list(_V2_CONTROLLERS)
    return [name for name in (*_V2_CONTROLLERS, *_V2_OPTIONAL) if name in enabled]
