"""The zygote: the process a pool's calls are forked from, and the call processes it forks.

Kept apart from the pool (:mod:`.pool`), which only asks it for a child per worker and replaces
it when it fails: here is the control protocol with it (requests over a Unix socket carrying the
call's pipe ends) and the child each answer becomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass

from nemo_orch.tools.sandbox.identity import _SpawnError
from nemo_orch.tools.sandbox.plan import _Plan
from nemo_orch.tools.sandbox.protocol import _ZYGOTE, _ZYGOTE_ENVIRONMENT, INTERPRETER

logger = logging.getLogger(__name__)

# How long a worker may take to be forked and to report itself ready.
_SPAWN_TIMEOUT_S = 30.0
# A zygote's staged libraries are mounted (in its own mount namespace) on
# <temporary directory>/nemo_orch_sandbox_libs.<sandbox pid>.<random>.
_STAGING_PREFIX = "nemo_orch_sandbox_libs."


@dataclass
class _Child:
    """A call's process, forked by the zygote: the host pid of its session, the pipes to its
    stdin and from its stdout and stderr, and its exit status (``exited``: as
    ``asyncio.subprocess.Process.returncode``, negative for a signal), which its session's
    first process writes to a pipe of its own (a killed session writes none: SIGKILL)."""

    pid: int
    stdin: asyncio.StreamWriter
    stdout: asyncio.StreamReader
    exited: asyncio.Task

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)


async def _exit_status(status: asyncio.StreamReader) -> int:
    text = await status.read()
    return int(text) if text.lstrip(b"-").isdigit() else -signal.SIGKILL


class _Zygote:
    """The process a pool's calls are forked from (``_ZYGOTE``): the interpreter and the
    common standard modules loaded once, so a call's process costs a fork and its namespaces
    and mounts, not an interpreter start. Requests and answers travel over a Unix socket (a
    request carries the call's pipe ends); a call's end does not involve it. Anything
    unexpected from it (it exits, a request fails or gets no answer in time, an answer that
    does not parse) marks it ``failed`` and kills it, and the sandbox starts another; the
    children it forked die with it (``PR_SET_PDEATHSIG``)."""

    def __init__(
        self, proc: asyncio.subprocess.Process, control: socket.socket, staging: str | None
    ) -> None:
        self.proc, self.control, self.staging = proc, control, staging
        self.failed: str | None = None
        self._ids = itertools.count()
        self._forks: dict[int, asyncio.Future] = {}
        self._listener = asyncio.create_task(self._listen())

    @classmethod
    async def start(cls, plan: _Plan) -> _Zygote:
        # Where the zygote mounts its staged libraries (empty in this mount namespace).
        staging = None
        if plan.root is not None and plan.root.staged:
            staging = tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{os.getpid()}.")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                *plan.zygote_prefix,
                INTERPRETER,
                "-I",
                "-u",
                "-c",
                _ZYGOTE,
                stdin=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                env=_ZYGOTE_ENVIRONMENT,
                start_new_session=True,
            )
            proc.stdin.write(
                json.dumps(
                    {
                        "namespaces": plan.namespaces,
                        "control": theirs.fileno(),
                        "parent": os.getpid(),
                        "staging": staging and {"path": staging, "directories": plan.root.staged},
                    }
                ).encode()
            )
            await proc.stdin.drain()
            proc.stdin.close()
        except BaseException:
            ours.close()
            if staging is not None:
                os.rmdir(staging)
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours, staging)

    async def fork(self, config: dict) -> _Child:
        """A child for ``config`` (what :func:`enter` applies), its stdin and stdout piped
        here."""
        if self.failed is not None:
            raise _SpawnError(f"the zygote failed: {self.failed}")
        loop = asyncio.get_running_loop()
        request = next(self._ids)
        # Their ends: the call's stdin, its stdout and stderr, its session's exit status.
        ours, theirs = zip(
            *[
                (read, write) if index else (write, read)
                for index, (read, write) in enumerate(os.pipe() for _ in range(3))
            ]
        )
        answer = self._forks[request] = loop.create_future()
        try:
            socket.send_fds(
                self.control, [json.dumps({**config, "id": request}).encode()], list(theirs)
            )
            pid = await asyncio.wait_for(answer, _SPAWN_TIMEOUT_S)
        except BaseException as error:
            for fd in ours:
                os.close(fd)
            self._forks.pop(request)  # before _fail: nobody awaits it any more
            self._fail(f"fork request: {error!r}")
            raise _SpawnError(f"the zygote did not fork: {error!r}") from None
        else:
            self._forks.pop(request)
        finally:
            for fd in theirs:
                os.close(fd)
        stdin, stdout, status = ours
        readers = [asyncio.StreamReader(limit=1 << 20) for _ in range(2)]
        for reader, fd in zip(readers, (stdout, status)):
            await loop.connect_read_pipe(
                lambda reader=reader: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
            )
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(stdin, "wb", 0)
        )
        return _Child(
            pid,
            asyncio.StreamWriter(transport, protocol, None, loop),
            readers[0],
            asyncio.create_task(_exit_status(readers[1])),
        )

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while message := await loop.sock_recv(self.control, 4096):
                answer = json.loads(message)
                self._forks[answer["id"]].set_result(answer["pid"])
            self._fail("it exited")
        except (OSError, ValueError, KeyError, asyncio.InvalidStateError) as error:
            self._fail(f"{type(error).__name__}: {error}")

    def _fail(self, reason: str) -> None:
        """Mark it failed and kill it (its children die with it)."""
        if self.failed is None:
            self.failed = reason
            logger.warning("python_sandbox: replacing the zygote (%s)", reason)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        for future in self._forks.values():
            if not future.done():
                future.set_exception(_SpawnError(reason))

    async def close(self) -> None:
        """Stop it (its idle children die with it) and wait for it to exit."""
        self.control.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()
        self._listener.cancel()
        await asyncio.gather(self._listener, return_exceptions=True)
        if self.staging is not None:
            os.rmdir(self.staging)
