"""The validation filters every generated or synthesized task must pass before it is kept.

The reference pipeline keeps what the LLM wrote; these filters drop, and report, every task that
cannot be scored honestly:

* ``schema``: the task can be scored here (no environment assertions, no natural-language
  assertions in the reward basis), and every gold action names a tool of the domain and its
  arguments validate against that tool's schema (a user-side action has no tool here);
* ``execution``: the gold actions run without error, in order, on a fresh database;
* ``no_effect``: a task whose gold actions write must change the database, and a task that
  changes nothing must at least ask for facts to be communicated (else doing nothing passes);
* ``budget``: at most ``max_actions`` gold actions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from nemo_orch.data.domain import ActionError, Domain
from nemo_orch.data.domain_tasks import DomainTask, gold_calls, replay, unscorable

FILTERS = ("schema", "execution", "no_effect", "budget")


@dataclass(frozen=True)
class Rejection:
    task_id: str
    filter: str
    reason: str


@dataclass
class ValidationSummary:
    """How many tasks were seen and kept, and each rejection with its filter and reason."""

    seen: int = 0
    kept: int = 0
    rejections: list[Rejection] = field(default_factory=list)

    def dropped(self) -> dict[str, int]:
        counts = Counter(rejection.filter for rejection in self.rejections)
        return {name: counts[name] for name in FILTERS}

    def to_json(self) -> dict:
        return {
            "seen": self.seen,
            "kept": self.kept,
            "dropped": self.dropped(),
            "rejections": [vars(rejection) for rejection in self.rejections],
        }


def rejection(domain: Domain, task: DomainTask, max_actions: int) -> Rejection | None:
    """Why ``task`` must be dropped (the first filter it fails), or None to keep it."""
    actions = task.gold_actions
    problem = unscorable(task)
    if problem is not None:
        return Rejection(task.id, "schema", problem)
    for action in actions:
        if action.requestor != "assistant":
            return Rejection(
                task.id,
                "schema",
                f"{action.name}: a user-side action; this domain has no user tools",
            )
        try:
            domain.spec.validate_arguments(action.name, action.arguments)
        except ActionError as error:
            return Rejection(task.id, "schema", str(error))
    gold = replay(domain, task, gold_calls(task))
    if gold.errors:
        return Rejection(task.id, "execution", gold.errors[0])
    changed = gold.state_hash != replay(domain, task, []).state_hash
    writes = any(domain.spec.tools[action.name].writes for action in actions)
    if writes and not changed:
        return Rejection(task.id, "no_effect", "its write actions leave the database as it was")
    if not changed and not task.facts:
        return Rejection(
            task.id,
            "no_effect",
            "it changes nothing and asks for no facts: doing nothing would pass",
        )
    if len(actions) > max_actions:
        return Rejection(
            task.id, "budget", f"{len(actions)} gold actions > max_actions={max_actions}"
        )
    return None


def validated(
    domain: Domain, tasks: Iterable[DomainTask], max_actions: int, summary: ValidationSummary
) -> Iterator[DomainTask]:
    """The tasks that pass every filter (streamed); ``summary`` records the rest."""
    for task in tasks:
        summary.seen += 1
        rejected = rejection(domain, task, max_actions)
        if rejected is None:
            summary.kept += 1
            yield task
        else:
            summary.rejections.append(rejected)
