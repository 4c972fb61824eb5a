"""The per-call limits of the ``python_sandbox`` tool."""

from __future__ import annotations

from dataclasses import dataclass

from nemo_orch.tools.base import ToolError


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits. ``cpu_seconds`` bounds the CPU time of the call's whole process tree,
    read from its cgroup's accounting (``cgroup-cpuacct``, or ``cgroup-cpu`` on v2) while it
    runs, and of each process (``RLIMIT_CPU``); ``cpu_cores`` is how many cores the tree may
    use at once (the ``cgroup-cpu`` quota); ``memory_mb`` bounds each process's address space
    and, with ``cgroup-memory``, the tree; ``max_disk_mb`` bounds the working directory (a
    tmpfs, where there is a mount namespace)."""

    timeout_s: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    max_file_mb: int = 16
    max_processes: int = 32
    max_output_bytes: int = 16384
    max_disk_mb: int = 64
    cpu_cores: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "cpu_seconds",
            "memory_mb",
            "max_file_mb",
            "max_processes",
            "max_output_bytes",
            "max_disk_mb",
            "cpu_cores",
        ):
            if getattr(self, name) <= 0:
                raise ToolError(f"python_sandbox: {name} must be > 0")
