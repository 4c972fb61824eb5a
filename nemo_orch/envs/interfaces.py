"""The environment seam: where tasks come from, the tools they run with and how an episode is
scored. GRPO's rollouts, SFT's demonstrations and evaluation all read tasks through it.

Splits: ``train`` and ``validation`` partition an environment's training pool by a hash of the
task id (``env.val_fraction`` of it is held out; the same task always lands on the same side,
whatever the order or seed), and ``test`` is what evaluation runs: a benchmark's whole file,
tau2's named split, the offline world's held-out tasks.

``tasks(split, count, seed)``: ``count=None`` returns every task of the split in order;
a ``count`` returns that many distinct tasks drawn with ``seed`` (deterministic for a seed;
a pool smaller than ``count`` gives all of it, shuffled).
"""

from __future__ import annotations

import abc
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nemo_orch.config import ConfigError, RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.reward.outcome import OutcomeResult
from nemo_orch.rollout.conversation import UserFactory
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.tools.interfaces import ANSWER
from nemo_orch.tools.registry import Toolbox

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Scored:
    """An episode's outcome and what the environment's scorer says beyond it (e.g. tau2's
    breakdown)."""

    outcome: OutcomeResult
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GoldAction:
    requestor: str  # "assistant", or "user" for tau2's user-side tools
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class GoldPlan:
    """A task's gold actions and the message that closes it (stating every required fact)."""

    actions: Sequence[GoldAction]
    final_message: str


def final_message(facts: Sequence[str]) -> str:
    """The assistant's closing message, stating every fact the user must be told."""
    if not facts:
        return "Your request has been handled."
    return "Your request has been handled. For your records: " + "; ".join(facts) + "."


@dataclass(frozen=True)
class EpisodeGroup:
    """One task's episodes of a training step, as an environment's own metrics see them: their
    trajectories and rewards, and the advantages they trained with (None: generated, not
    trained on)."""

    task: Task
    trajectories: Sequence[Trajectory]
    rewards: Sequence[float]
    advantages: Sequence[float] | None = None


class Oracle(Protocol):
    """What an environment that knows each task's best route tells of an episode."""

    def preference_adherence(self, task: Task, trajectory: Trajectory) -> float:
        """The expected utility of the route taken, for the task's preference, over the best
        route's (in [0, 1])."""


class Agent(Protocol):
    """Plays one episode: trial ``sample`` of ``task`` with ``seed``. Each trial is an episode
    of its own (its id, its environment state, its transcript)."""

    async def episode(self, task: Task, sample: int, seed: int) -> Trajectory: ...


class Environment(abc.ABC):
    """A task source. ``name`` labels it in metrics and reports; ``notes`` say what was
    dropped and why; ``preferences``: its tasks carry preference vectors (report adherence);
    ``has_gold_plan``: :meth:`gold_plan` works (the gold replay can run); ``baselines``: the
    agents of its own that an evaluation can run (``--agent NAME``, built by :meth:`baseline`);
    ``simulated_monolith``: a SIMULATED frontier model can answer its tasks (its experts are
    simulated from what its tasks state), so a monolith needs no endpoint."""

    name: str
    notes: dict[str, Any]
    preferences: bool = False
    has_gold_plan: bool = False
    baselines: tuple[str, ...] = ()
    simulated_monolith: bool = False

    @abc.abstractmethod
    def tasks(self, split: str, count: int | None, seed: int) -> list[Task]:
        """The tasks of ``split`` (see the module docstring)."""

    def under_each_preference(self, task: Task) -> list[Task]:
        """``task`` under each preference the environment can state (GRPO's
        ``preference_sets``); an environment without preferences has the task alone."""
        return [task]

    @abc.abstractmethod
    def toolbox(self) -> Toolbox:
        """The tools an agent runs with: the environment's own and the configured ones (not
        yet started: ``async with`` it)."""

    def user_toolbox(self) -> Toolbox | None:
        """The user side's tools, where the environment has a user who acts (tau2)."""
        return None

    def users(self) -> UserFactory | None:
        """Who answers the agent, made per episode, where someone does (tau2's LLM user);
        None: the task states everything up front."""
        return None

    @abc.abstractmethod
    async def score(self, task: Task, trajectory: Trajectory) -> Scored:
        """A finished episode's outcome (the reward's correctness) and the breakdown."""

    def gold_plan(self, task: Task) -> GoldPlan:
        raise NotImplementedError(f"{self.name} tasks have no gold actions")

    def baseline(
        self,
        kind: str,
        tasks: Sequence[Task],
        toolbox: Toolbox,
        tokenizer: Any,
        settings: RolloutConfig,
        seed: int,
    ) -> Agent:
        """The baseline agent ``kind`` (one of :attr:`baselines`) for an evaluation of
        ``tasks`` with ``toolbox``, its episodes rendered with ``tokenizer``."""
        raise NotImplementedError(f"{self.name} has no baseline agent {kind!r}")

    def routed_tools(self, task: Task) -> tuple[str, ...]:
        """The tools of ToolOrchestra's interface a fixed router calls for ``task``, in order,
        each with one of its models: ``answer`` alone unless the environment knows better."""
        return (ANSWER,)

    def rollout_metrics(self, groups: Sequence[EpisodeGroup]) -> dict[str, float]:
        """The environment's own metrics of a training step's groups of its tasks (every group
        generated), logged beside the generic ones: what only it can name, such as the offline
        world's routes per (family, preference) group (NeMo-RL's
        ``global_post_process_and_metrics``). None by default."""
        return {}

    def tokenizer_conversations(self, count: int, seed: int) -> list[dict[str, Any]]:
        """Conversations (``{"messages": [...]}``) in the environment's vocabulary, for a
        tokenizer trained for a run that names no conversation file: by default the prompts
        (system and question) of ``count`` of its train tasks."""
        return [
            {
                "messages": [
                    *([{"role": "system", "content": task.system}] if task.system else []),
                    {"role": "user", "content": task.question},
                ]
            }
            for task in self.tasks("train", count, seed)
        ]

    def copy_conversations(self, count: int, seed: int) -> list[dict[str, Any]]:
        """``count`` SFT conversations that copy a span of the request into the answer, in the
        environment's vocabulary (``data.num_copy_conversations``); an environment without
        them refuses any."""
        if count:
            raise ConfigError(
                f"{self.name} has no copy conversations: set data.num_copy_conversations=0"
            )
        return []

    def oracle(self, toolbox: Toolbox, tokenizer: Any) -> Oracle | None:
        """The best route of each task, where the environment knows it (None: it does not).
        A route's price counts the policy's own tokens, so the oracle takes the tools the
        episodes run with (``toolbox``) and the policy's ``tokenizer``."""
        return None


def in_validation(task_id: str, val_fraction: float) -> bool:
    """Whether a task of a training pool is held out for validation (a hash of its id)."""
    digest = hashlib.sha256(task_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def split_pool(
    pool: Sequence[Task], split: str, val_fraction: float, test: Sequence[Task] | None = None
) -> list[Task]:
    """The tasks of ``split`` from a training ``pool`` (``test``: the evaluation tasks; None:
    the whole pool)."""
    if split == "test":
        return list(pool if test is None else test)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    held_out = split == "validation"
    return [task for task in pool if in_validation(task.id, val_fraction) == held_out]


def draw(tasks: Sequence[Task], count: int | None, seed: int) -> list[Task]:
    """All of ``tasks`` in order (``count=None``), or ``count`` distinct ones drawn with
    ``seed``."""
    if count is None:
        return list(tasks)
    return random.Random(seed).sample(list(tasks), min(count, len(tasks)))
