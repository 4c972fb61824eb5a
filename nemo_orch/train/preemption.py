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

import signal
from pathlib import Path

STOP_SIGNAL = signal.SIGUSR1
# EX_TEMPFAIL: stopped on request with a checkpoint; running the same command again resumes.
REQUEUE_EXIT_CODE = 75


class StopRequested(Exception):
    """The run stopped on request after ``step``, checkpointed in ``checkpoint``."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(
            f"stopped on request ({STOP_SIGNAL.name}) after step {step}; checkpoint {checkpoint}"
        )
        self.step = step
        self.checkpoint = checkpoint


def listen() -> None:
    """From now on, keep :data:`STOP_SIGNAL` pending in this process rather than delivered
    (idempotent), for :func:`agreed` to find. Blocked, not handled: the processes this one
    starts (checkpoint writers, the sandbox, servers) inherit the block, and SLURM signals every
    process of the job's step, which would kill them; and a signal that comes while the job
    starts stays pending (its entry point calls this first thing) rather than being lost."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})


def agreed() -> bool:
    """Collective: whether :data:`STOP_SIGNAL` reached any rank (taking it off this one's
    pending signals). Every rank calls it after each step, so all stop after the same one."""
    import torch  # here: the command line imports this module for its exit code
    import torch.distributed as dist

    signalled = signal.sigtimedwait([STOP_SIGNAL], 0) is not None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return signalled
    flag = torch.tensor([int(signalled)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
