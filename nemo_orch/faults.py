"""Fault injection for crash-recovery tests: ``NEMO_ORCH_KILL_AT=<point>:<step>`` SIGKILLs the
process (no cleanup, no flush) when it reaches that point, e.g. ``step:4`` (before training step 4)
or ``save:3`` (after the step-3 shards are written, before the checkpoint is marked complete),
``turn:12`` (after a journal's 12th policy turn generated, not replayed) or ``call:5`` (after a
recording's or journal's 5th entry kept: a call, or a journal's policy turn)."""

from __future__ import annotations

import os
import signal

ENV = "NEMO_ORCH_KILL_AT"


def maybe_kill(point: str, step: int) -> None:
    if os.environ.get(ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
