"""A worker's identity: an unprivileged uid no other worker on the host holds at the same time."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Workers' uids are uid_base + [0, _UID_COUNT), each held by one worker on the host at a time: a
# lock file per uid under _UID_LOCKS, flock'ed for the worker's life (a killed holder's lock dies
# with its descriptors). Each process starts its search at its own offset to meet fewer taken ones.
_UID_COUNT = 1000
_UID_LOCKS = "nemo-orch-sandbox-uids"
_UID_NEXT = itertools.count(os.getpid() % _UID_COUNT)


class _SpawnError(RuntimeError):
    """A worker could not be made (defined here, the lowest part that raises it: no free uid)."""


@dataclass
class _UidLease:
    """A uid held by one worker on this host (its lock file's ``flock``) until ``release``."""

    uid: int
    fd: int

    def release(self) -> None:
        os.close(self.fd)


def _lease_uid(uid_base: int) -> _UidLease:
    """A uid of ``uid_base + [0, _UID_COUNT)`` no other worker on this host holds, by any
    process (uids are only leased where this process is root)."""
    parent = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    locks = parent / _UID_LOCKS
    with contextlib.suppress(FileExistsError):
        locks.mkdir(mode=0o700)
    info = locks.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise _SpawnError(f"{locks} is not a directory of this user's: cannot lease uids")
    for _ in range(_UID_COUNT):
        uid = uid_base + next(_UID_NEXT) % _UID_COUNT
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return _UidLease(uid, fd)
    raise _SpawnError(f"all {_UID_COUNT} uids from {uid_base} are held by other workers")


def _count_processes(uid: int) -> int:
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        uid_line = next((line for line in text.splitlines() if line.startswith("Uid:")), "")
        count += uid_line.split()[1:2] == [str(uid)]
    return count
