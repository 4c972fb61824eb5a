"""Stopping a training run early, on request, after a whole step and with a checkpoint: how a
SLURM job stops before its time limit and is requeued.

SLURM sends the job's processes SIGUSR1 some time before the limit (``--signal=USR1@T``,
``launcher.slurm.stop_before_limit_s``). Each rank notes it; at the end of every step the ranks
agree (the request of any rank counts: a signal reaches them at slightly different moments),
so all stop after the same step. The loop then checkpoints that step and raises
:class:`StopRequested`; the command exits with :data:`REQUEUE_EXIT_CODE`, on which the batch
script requeues the job, and the same command resumes from the checkpoint. The request is only
read after a step, so every attempt makes progress however early the signal comes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

STOP_SIGNAL = signal.SIGUSR1
# EX_TEMPFAIL: stopped on request with a checkpoint; running the same command again resumes.
REQUEUE_EXIT_CODE = 75


class StopRequested(Exception):
    """The run stopped on request after ``step``, checkpointed in ``checkpoint``."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped on request ({STOP_SIGNAL.name}) after step {step}; "
                         f"checkpoint {checkpoint}: run the same command again to resume")
        self.step = step
        self.checkpoint = checkpoint


class StopRequest:
    """Whether :data:`STOP_SIGNAL` reached this process (see :func:`on_signal`)."""

    def __init__(self) -> None:
        self.signalled = False

    def agreed(self) -> bool:
        """Collective: whether any rank was signalled. Every rank calls it after each step."""
        import torch  # here: the command line imports this module for its exit code
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signalled
        flag = torch.tensor([int(self.signalled)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@contextlib.contextmanager
def on_signal() -> Iterator[StopRequest]:
    """A :class:`StopRequest` set by :data:`STOP_SIGNAL` while the block runs (off the main
    thread, where no handler can be installed, it is never set)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def note(signum: int, frame: object) -> None:
        request.signalled = True

    previous = signal.signal(STOP_SIGNAL, note)
    try:
        yield request
    finally:
        signal.signal(STOP_SIGNAL, previous)
