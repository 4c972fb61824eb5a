"""Fault injection for crash-recovery tests: ``NEMO_ORCH_KILL_AT=<point>:<step>`` SIGKILLs the
process (no cleanup, no flush) when it reaches that point, e.g. ``step:4`` (before training step 4)
or ``save:3`` (after the step-3 shards are written, before the checkpoint is marked complete)."""

from __future__ import annotations

import os
import signal

ENV = "NEMO_ORCH_KILL_AT"


def maybe_kill(point: str, step: int) -> None:
    if os.environ.get(ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
