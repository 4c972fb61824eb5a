"""Episodes that resume: the journal of a run's episodes (``grpo.journal``).

The journal is a call store (:mod:`nemo_orch.clients.call_store`; ``<stage>/episodes.db``) in
``replay_or_call`` mode that every episode of a GRPO, PPO or DPO stage goes through, each in a
scope of its own (its id and seed): the policy's turns (each a :class:`Generation`, keyed by its
prompt and sampling, the turn's seed included) and, where ``calls.*`` records nothing else,
every HTTP call outside the policy (experts, judges, users, search). A step killed midway (a kill,
a SLURM requeue) and run again from the last checkpoint draws the same tasks and seeds on the
same weights: each episode gets its completed turns and calls back from the journal, in order,
and continues live from its last completed turn -- no completed turn is generated, and no
completed call made, again. Tools that run here run again, which restores an environment's
state (a domain's database replays its calls). A policy turn's key holds the weights' version
and an episode's scope the version it started on: the same tasks and seeds on other weights (a
later step's validation) are other episodes. A run from other starting weights empties the
journal first (``episodes.db.start``). An evaluation keeps one per system
(``eval.journal``; :mod:`nemo_orch.eval.harness`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from nemo_orch import faults
from nemo_orch.clients import call_store
from nemo_orch.clients.call_store import CallStore, Recording
from nemo_orch.config import Config
from nemo_orch.rollout.engines.base import Generation, SamplingParams

log = logging.getLogger(__name__)

JOURNAL = "episodes.db"  # a training stage's, in its directory
START_SUFFIX = ".start"  # beside the journal: what its episodes go back to

_journal: Recording | None = None
_generated = 0  # the policy turns this process generated (not replayed)


def active() -> Recording | None:
    """The journal the policy's turns go through (None: none is kept)."""
    return _journal


def start_of(weights: Path | None) -> str:
    """What names a run's starting weights (``trainer.init_from``): each file's path, size and
    time of change (None: weights the run initializes from its seed)."""
    if weights is None:
        return "initialized"
    files = [weights] if weights.is_file() else sorted(p for p in weights.rglob("*") if p.is_file())
    return call_store.digest(
        [[str(f.relative_to(weights)), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    )


@contextmanager
def journaling(path: Path, max_mb: float, start: str, fresh: bool = False) -> Iterator[Recording]:
    """The journal in ``path`` kept while the block runs, for episodes that go back to
    ``start`` (for a training run its starting weights, :func:`start_of`; for an evaluation
    what decides its results): a journal of another start, or any where ``fresh``, is emptied
    first. The HTTP calls go through it too unless ``calls.*`` records them already."""
    global _journal
    marker = path.with_name(path.name + START_SUFFIX)
    if fresh or not marker.exists() or marker.read_text() != start:
        for stale in path.parent.glob(f"{path.name}*"):  # the database, its WAL and index
            stale.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(start)
    _journal = Recording(CallStore(path, max_mb), "replay_or_call", inline=True)
    try:
        if call_store.active() is None:
            with call_store.using(_journal):
                yield _journal
        else:
            yield _journal
    finally:
        log.info("journal %s: %s", path, _journal.counts())
        _journal = None


def of_stage(config: Config) -> AbstractContextManager[Recording | None]:
    """A training stage's journal (``<stage>/episodes.db``; ``grpo.journal``), for a run from
    the weights in ``trainer.init_from``; none where it keeps none (Ray's rollout workers keep
    none: the episode scope does not reach their tool executors' processes)."""
    if not config.grpo.journal:
        return nullcontext()
    if config.rollout.backend == "ray":
        log.info("grpo.journal: Ray's rollout workers keep no journal (rollout.backend=ray)")
        return nullcontext()
    init_from = config.trainer.init_from
    start = start_of(None if init_from is None else Path(init_from))
    return journaling(config.run.dir / JOURNAL, config.calls.max_mb, start)


def policy_key(prompt_ids: list[int], params: SamplingParams, version: int | None) -> str:
    """What decides a policy turn: its prompt, sampling (the turn's seed included) and the
    weights' version."""
    return call_store.digest(
        {"prompt": prompt_ids, "params": dataclasses.asdict(params), "version": version}
    )


async def generate(
    prompt_ids: list[int],
    params: SamplingParams,
    version: int | None,
    live: Callable[[], Awaitable[Generation]],
) -> Generation:
    """A policy turn (on the weights ``version``) through the journal where one is kept, else
    ``live()``."""
    global _generated
    replayed = False
    if _journal is None:
        generation = await live()
    else:
        with call_store.noting_calls() as noted:
            generation = await _journal.through(
                policy_key(prompt_ids, params, version),
                "policy",
                {"prompt_tokens": len(prompt_ids), "seed": params.seed},
                live,
                encode=dataclasses.asdict,
                decode=lambda stored: Generation(**stored),
            )
        replayed = noted[-1].replayed
    if not replayed:
        _generated += 1
        faults.maybe_kill("turn", _generated)  # tests: killed after the n-th turn generated
    return generation
