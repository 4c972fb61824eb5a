"""The isolation plan: which mechanisms a pool's workers are made with."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from nemo_orch.tools.sandbox.cgroups import V2, _v2_controllers
from nemo_orch.tools.sandbox.root import _KEYCTL, PrivateRoot

ISOLATION_MODES = ("auto", "strict", "rlimits")


@dataclass(frozen=True)
class _Plan:
    """How workers are made: whether each gets fresh network, mount, PID, IPC, UTS and cgroup
    namespaces and a tmpfs working directory (``namespaces``; on a host where this process is
    not root the zygote runs in a user namespace of its own, root there), which uid they drop
    to and whether they then enter a user namespace of their own (``userns``), which
    directories are re-exposed in the mount namespace (or the private root they see instead),
    the cgroup parents used, whether calls run under the system-call filter (``seccomp``),
    whether a user namespace of the call's owns its other namespaces (``owned_namespaces``) and
    where calls import the allowed packages from (``sys_path``)."""

    namespaces: bool = False
    uid_base: int | None = None
    mounts: tuple[tuple[str, tuple[str, ...]], ...] = ()
    cgroups: tuple[tuple[str, Path], ...] = ()
    root: PrivateRoot | None = None
    userns: bool = False
    seccomp: bool = False
    owned_namespaces: bool = False
    sys_path: tuple[str, ...] = ()

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
        if self.owned_namespaces:
            names.append("owned-namespaces")
        if self.root is not None:
            names.append("private-root")
        if self.mounts:
            names.append("mountns")
        if self.uid_base is not None:
            names += ["uid"] + (["keyrings"] if platform.machine() in _KEYCTL else [])
        if self.userns:
            names.append("userns")
        for controller, parent in self.cgroups:
            names += (
                [f"cgroup-{name}" for name in _v2_controllers(parent)] + ["cgroup-v2"]
                if controller == V2
                else [f"cgroup-{name}" for name in controller.split(",")]
            )
        return (*names, "rlimits", "no-new-privs", *(("seccomp",) if self.seccomp else ()))
