"""The sandbox's system-call filter as a program: its tables against libseccomp's, and its
verdicts run by the kernel in a child process (the sandbox's own calls: test_sandbox_hostile)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest

from nemo_orch.tools.sandbox import seccomp


@pytest.mark.parametrize("arch", list(seccomp.ARCHES.values()), ids=list(seccomp.ARCHES))
def test_the_tables_agree_with_libseccomp(arch: seccomp.Arch):
    name = ctypes.util.find_library("seccomp")
    if name is None:
        pytest.skip("no libseccomp here to check the tables against")
    lib = ctypes.CDLL(name)
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    # libseccomp's architecture tokens are the audit numbers.
    resolved = {
        call: lib.seccomp_syscall_resolve_name_arch(arch.audit, call.encode())
        for call in (*seccomp.DENIED, *seccomp.ARGUMENT_CHECKED)
    }
    assert {call: resolved[call] for call in arch.numbers} == arch.numbers
    # What a table leaves out, the architecture lacks (a negative pseudo-number).
    assert all(number < 0 for call, number in resolved.items() if call not in arch.numbers)
    assert set(seccomp.ARGUMENT_CHECKED) <= arch.numbers.keys()


def test_every_jump_lands_ahead():
    program = seccomp._Program()
    program.label("back")
    program.jump(0x15, 1, "back")
    with pytest.raises(ValueError, match="jump out of range"):
        program.assemble()


# Installs the filter, then tries calls; prints each outcome (an errno name or "ok").
CHILD = r"""
import ctypes, errno, json, os, socket, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
program = bytes.fromhex(sys.argv[1])
numbers = json.loads(sys.argv[2])
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs: an unprivileged filter needs it
assert libc.prctl(22, 2, ctypes.byref(Fprog(len(program) // 8, program)), 0, 0) == 0
def raw(name, *args):
    result = libc.syscall(numbers[name], *[ctypes.c_long(a) for a in args])
    return "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
def sock(*args):
    try:
        socket.socket(*args).close()
        return "ok"
    except OSError as error:
        return errno.errorcode[error.errno]
out = {"bpf": raw("bpf", 0, 0, 0), "inotify_init1": raw("inotify_init1", 0),
       "unshare": raw("unshare", 0x40000000), "mount": raw("mount", 0, 0, 0, 0, 0),
       "clone_newnet": raw("clone", 0x40000000 | 17, 0, 0, 0, 0),
       "clone3": raw("clone3", 0, 0), "vsock": sock(40, socket.SOCK_STREAM),
       "uevent": sock(socket.AF_NETLINK, socket.SOCK_DGRAM, 15),
       "route": sock(socket.AF_NETLINK, socket.SOCK_RAW, 0),
       "inet": sock(socket.AF_INET, socket.SOCK_STREAM), "unix": sock(socket.AF_UNIX)}
thread = threading.Thread(target=out.__setitem__, args=("thread", "ok"))
thread.start()
thread.join()
out["subprocess"] = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True,
                                   text=True).stdout.strip()
print(json.dumps(out))
"""


def test_the_kernel_runs_the_filter_as_meant():
    arch = seccomp.host_arch()
    if arch is None:
        pytest.skip("no system-call table for this machine")
    result = subprocess.run(
        [sys.executable, "-c", CHILD, seccomp.program(arch).hex(), json.dumps(arch.numbers)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    verdicts = json.loads(result.stdout)
    assert verdicts == {
        "bpf": "EPERM",
        "inotify_init1": "EPERM",
        "unshare": "EPERM",
        "mount": "EPERM",
        "clone_newnet": "EPERM",
        "clone3": "ENOSYS",
        "vsock": "EPERM",
        "uevent": "EPERM",
        "route": "ok",
        "inet": "EPERM",
        "unix": "ok",
        "thread": "ok",
        "subprocess": "ok",
    }
