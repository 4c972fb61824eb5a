"""The call's system-call filter: a classic-BPF seccomp program generated here for the host's
architecture and installed by the call's process after its setup, before its code
(``enter`` in the zygote's program).

A denied call fails with ``EPERM`` (the process is not killed), so an ordinary program gets a
Python ``PermissionError``. Denied, whatever the host's sysctls allow:

* observing or reaching outside the call: ``perf_event_open``, ``bpf``, ``userfaultfd``,
  ``io_uring_*``, inotify and fanotify (a watch follows a bound host file, not the mount),
  ``ptrace``, ``process_vm_*``, ``kcmp``, ``pidfd_getfd``, ``syslog``, handles by inode;
* sockets of every family but ``AF_UNIX`` (and ``AF_NETLINK``'s routing protocol, which the C
  library asks for interfaces), ``socket`` and ``socketpair`` alike: no vsock, packet or uevent
  socket, and no IP one either (the call's network namespace has no route out anyway);
* changing the system: mounts (and the new mount API), ``pivot_root``, ``chroot``, modules,
  ``kexec``, ``reboot``, swap, ``acct``, quotas, the clocks, ``iopl``/``ioperm``;
* ``request_key``, whose upcall runs a helper on the host (the call's own keyrings, made
  before, stay usable with ``add_key`` and ``keyctl``);
* namespaces: ``unshare``, ``setns`` and ``clone`` with a namespace flag; ``clone3``, whose
  flags a filter cannot read, answers ``ENOSYS`` so the C library falls back to ``clone``;
* ``ioctl(TIOCSTI)``: typing into a terminal.

Two architectures are known (x86-64 and AArch64); the tables are checked against libseccomp's
where it is installed (tests). On another architecture the sandbox runs without the filter and
says so (``PythonSandbox.isolation`` lacks ``seccomp``).
"""

from __future__ import annotations

import functools
import platform
import struct
from dataclasses import dataclass

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian: an
# argument's low 32 bits at its offset).
_NR, _ARCH = 0, 4


def _arg(index: int) -> int:
    return 16 + 8 * index


_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
AF_UNIX, AF_NETLINK = 1, 16
NETLINK_ROUTE = 0
TIOCSTI = 0x5412
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
# CLONE_NEWNET, CLONE_NEWTIME.
CLONE_NAMESPACES = (
    0x00020000
    | 0x02000000
    | 0x04000000
    | 0x08000000
    | 0x10000000
    | 0x20000000
    | 0x40000000
    | 0x00000080
)

# The denied calls by name; a name an architecture lacks (inotify_init on AArch64) is skipped.
DENIED = (
    "perf_event_open",
    "bpf",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "inotify_init",
    "inotify_init1",
    "inotify_add_watch",
    "fanotify_init",
    "fanotify_mark",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "syslog",
    "name_to_handle_at",
    "open_by_handle_at",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "iopl",
    "ioperm",
    "request_key",
    "unshare",
    "setns",
    "lookup_dcookie",
    "vhangup",
    "uselib",
)
# The calls whose arguments decide (clone3: answered ENOSYS).
ARGUMENT_CHECKED = ("socket", "socketpair", "clone", "clone3", "ioctl")


@dataclass(frozen=True, eq=False)
class Arch:
    """An architecture's audit number and system-call numbers; on x86-64 also the first
    number of the x32 calls it takes too (a second table, denied whole)."""

    name: str
    audit: int
    numbers: dict[str, int]
    first_foreign: int | None = None


X86_64 = Arch(
    "x86_64",
    0xC000003E,
    {
        "socket": 41,
        "socketpair": 53,
        "clone": 56,
        "clone3": 435,
        "ioctl": 16,
        "perf_event_open": 298,
        "bpf": 321,
        "userfaultfd": 323,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "inotify_init": 253,
        "inotify_init1": 294,
        "inotify_add_watch": 254,
        "fanotify_init": 300,
        "fanotify_mark": 301,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "pidfd_getfd": 438,
        "syslog": 103,
        "name_to_handle_at": 303,
        "open_by_handle_at": 304,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "chroot": 161,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "kexec_load": 246,
        "kexec_file_load": 320,
        "reboot": 169,
        "swapon": 167,
        "swapoff": 168,
        "acct": 163,
        "quotactl": 179,
        "settimeofday": 164,
        "clock_settime": 227,
        "clock_adjtime": 305,
        "adjtimex": 159,
        "iopl": 172,
        "ioperm": 173,
        "request_key": 249,
        "unshare": 272,
        "setns": 308,
        "lookup_dcookie": 212,
        "vhangup": 153,
        "uselib": 134,
    },
    first_foreign=0x40000000,
)
AARCH64 = Arch(
    "aarch64",
    0xC00000B7,
    {
        "socket": 198,
        "socketpair": 199,
        "clone": 220,
        "clone3": 435,
        "ioctl": 29,
        "perf_event_open": 241,
        "bpf": 280,
        "userfaultfd": 282,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "inotify_init1": 26,
        "inotify_add_watch": 27,
        "fanotify_init": 262,
        "fanotify_mark": 263,
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "pidfd_getfd": 438,
        "syslog": 116,
        "name_to_handle_at": 264,
        "open_by_handle_at": 265,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "chroot": 51,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
        "init_module": 105,
        "finit_module": 273,
        "delete_module": 106,
        "kexec_load": 104,
        "kexec_file_load": 294,
        "reboot": 142,
        "swapon": 224,
        "swapoff": 225,
        "acct": 89,
        "quotactl": 60,
        "settimeofday": 170,
        "clock_settime": 112,
        "clock_adjtime": 266,
        "adjtimex": 171,
        "request_key": 218,
        "unshare": 97,
        "setns": 268,
        "lookup_dcookie": 18,
        "vhangup": 58,
    },
)
ARCHES = {arch.name: arch for arch in (X86_64, AARCH64)}


def host_arch() -> Arch | None:
    """The running machine's architecture, None where no table is known."""
    return ARCHES.get(platform.machine())


class _Program:
    """A classic-BPF program with conditional jumps to labels ahead (resolved on
    :meth:`assemble`; classic BPF jumps forward only, at most 255 instructions)."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int | str, int | str, int]] = []
        self.labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self.code.append((_LD_W_ABS, 0, 0, offset))

    def jump(self, op: int, k: int, true: int | str = 0, false: int | str = 0) -> None:
        self.code.append((op, true, false, k))

    def ret(self, value: int) -> None:
        self.code.append((_RET_K, 0, 0, value))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = bytearray()
        for index, (op, true, false, k) in enumerate(self.code):
            offsets = [
                self.labels[j] - index - 1 if isinstance(j, str) else j for j in (true, false)
            ]
            if not all(0 <= offset < 256 for offset in offsets):
                raise ValueError(f"seccomp: jump out of range at instruction {index}")
            out += struct.pack("<HBBI", op, *offsets, k)
        return bytes(out)


@functools.cache
def program(arch: Arch) -> bytes:
    """The filter for ``arch`` as ``struct sock_filter`` bytes."""
    numbers = arch.numbers
    p = _Program()
    p.load(_ARCH)
    p.jump(_JEQ_K, arch.audit, 1, 0)
    p.ret(_RET_KILL_PROCESS)  # a call of another ABI (e.g. 32-bit): its numbers mean else
    p.load(_NR)
    if arch.first_foreign is not None:
        p.jump(_JGE_K, arch.first_foreign, "deny")
    for name in DENIED:
        if name in numbers:
            p.jump(_JEQ_K, numbers[name], "deny")
    p.jump(_JEQ_K, numbers["socket"], "socket")
    p.jump(_JEQ_K, numbers["socketpair"], "socket")
    p.jump(_JEQ_K, numbers["clone"], "clone")
    p.jump(_JEQ_K, numbers["clone3"], "enosys")
    p.jump(_JEQ_K, numbers["ioctl"], "ioctl")
    p.ret(_RET_ALLOW)
    # Classic BPF jumps only forward: the argument checks, then every verdict they reach.
    p.label("socket")
    p.load(_arg(0))
    p.jump(_JEQ_K, AF_UNIX, "allow")
    p.jump(_JEQ_K, AF_NETLINK, 0, "deny")
    p.load(_arg(2))
    p.jump(_JEQ_K, NETLINK_ROUTE, "allow", "deny")
    p.label("clone")
    p.load(_arg(0))
    p.jump(_JSET_K, CLONE_NAMESPACES, "deny", "allow")
    p.label("ioctl")
    p.load(_arg(1))
    p.jump(_JEQ_K, TIOCSTI, "deny", "allow")
    p.label("allow")
    p.ret(_RET_ALLOW)
    p.label("enosys")
    p.ret(_RET_ERRNO | ENOSYS)
    p.label("deny")
    p.ret(_RET_ERRNO | EPERM)
    return p.assemble()
