"""The offline world on ToolOrchestra's own tool interface: ``search(model)``,
``enhance_reasoning(model)`` and ``answer(model)``.

The policy only chooses the tool and the model alias; the chosen expert (SIMULATED, see
:mod:`nemo_orch.tools.simulated_expert`) writes the query, the program or the answer from the
task and the episode's observations, and the **real** retriever and sandbox execute them
(:mod:`nemo_orch.tools.composite`, declarations in ``conf/tools/orchestra/``). Nothing asks the
policy to copy.

* ``search``: the query writer writes the query that finds the task's fact with its alias's
  accuracy, the same search for another entity otherwise (its passage holds no evidence);
* ``enhance_reasoning``: the coder writes the task's program with its alias's accuracy for the
  code's difficulty, a subtly wrong one (off by a little) otherwise, and one with a guessed
  fact when the fact it needs is in no observation it sees;
* ``answer``: the answerer is right with its alias's accuracy for what it reads (the printed
  answer, the passage, or nothing: its accuracy for the task's own difficulty), times its
  ``distraction`` per observation that holds no evidence; its answer ends the episode.

A route is the calls of an episode, named by their aliases (``search-2>answer-4``); its
*shape* is the set of tools it calls. :func:`route_values` gives every route of up to
:data:`MAX_CALLS` calls its expected accuracy, USD and utility by enumerating the writers'
outcomes, with the same texts, accuracies and prices the simulation uses.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_orch.config import DEMO_ROUTERS
from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline.task_families import OfflineTask
from nemo_orch.envs.offline.values import RouteValue, utility
from nemo_orch.envs.offline.world_facts import world_passage
from nemo_orch.reward.components import PREFERENCE_PHRASES
from nemo_orch.tools.base import ToolContext, Usage
from nemo_orch.tools.composite import context_text, fit_observations
from nemo_orch.tools.interfaces import ANSWER, ORCHESTRA_TOOLS, REASON, SEARCH
from nemo_orch.tools.registry import Toolbox
from nemo_orch.tools.simulated_expert import SimulatedExpert, reading, writing_chances, wrong_answer

WRITERS = (SEARCH, REASON)
MAX_CALLS = 3
Route = tuple[tuple[str, dict[str, Any]], ...]

# The preferences the user states. "budget" is accuracy within the task's USD budget, which
# the user's message states after the question (metadata ``budget_usd``).
PREFERENCE_VECTORS: dict[str, dict[str, float]] = {
    "accuracy": {"accuracy": 1.0},
    "cost": {"accuracy": 1.0, "cost": 1.0},
    "neutral": {"accuracy": 1.0, "cost": 0.35},
    "no_code": {"accuracy": 1.0, f"tool:{REASON}": -1.0},
    "no_search": {"accuracy": 1.0, f"tool:{SEARCH}": -1.0},
    "budget": {"accuracy": 1.0},
}
BUDGET_USD = 0.027
# The preferences a family's tasks get: in every family at least two have different best
# routes (tests/envs/test_offline_orchestra.py checks it, and the margins).
FAMILY_PREFERENCES: dict[str, tuple[str, ...]] = {
    "arithmetic": ("accuracy", "cost", "no_code", "no_search"),
    "lookup": ("accuracy", "cost", "neutral"),
    "lookup_compute": ("accuracy", "cost", "budget"),
    "math": ("accuracy", "cost", "no_code", "budget"),
    "word": ("accuracy", "cost", "no_search"),
}
# The tools each family's task is naturally solved with (the naive routers' shapes).
FAMILY_SHAPES: dict[str, tuple[str, ...]] = {
    "arithmetic": (REASON, ANSWER),
    "lookup": (SEARCH, ANSWER),
    "lookup_compute": (SEARCH, REASON, ANSWER),
    "math": (REASON, ANSWER),
    "word": (ANSWER,),
}


# How hard a family's program is for a coder (number theory: the task's own easy or hard).
CODE_DIFFICULTY = {"arithmetic": "easy", "lookup_compute": "easy", "word": "language"}


def instruction(preference: str, rng: random.Random) -> str | None:
    """The phrasing of a preference that has its own (the budget's), else None."""
    return rng.choice(PREFERENCE_PHRASES[preference]) if preference == "budget" else None


def _bug(program: str, answer: str, key: str) -> tuple[str, str]:
    """``program`` off by a little (an off-by-k, a dropped character), and what it prints."""
    if answer.lstrip("-").isdigit():
        # A shift whose digits are not the answer: the program text must not state it.
        shift = random.Random(f"bug|{key}").choice(
            [shift for shift in (1, 2, 3) if str(shift) != answer.lstrip("-")]
        )
        sign = random.Random(f"sign|{key}").choice(("+", "-"))
        printed = int(answer) + (shift if sign == "+" else -shift)
        return program.removesuffix("print(result)") + f"print(result {sign} {shift})", str(printed)
    return program.removesuffix("print(result)") + "print(result[1:])", answer[1:]


def task_metadata(drawn: OfflineTask) -> dict[str, Any]:
    """What this interface's simulated writers and oracle read of a task (see the module
    docstring): the answerer's difficulty and evidence, the queries and their passages, the
    programs and what each prints."""
    family, answer = drawn.family, drawn.answer
    evidence: list[list[str]] = [[answer, "given"]]
    if family == "lookup":
        evidence = [[answer, "language"]]
    elif family == "lookup_compute":
        evidence = [[answer, "given"], [drawn.evidence, "exact"]]
    if drawn.program is None:  # no program knows the made-up world: it prints a guess
        guess = wrong_answer(answer, random.Random(f"guess|{drawn.question}"))
        code = {
            "right": None,
            "wrong": f"print({guess!r})",
            "blind": None,
            "needs": None,
            "difficulty": "unknown",
            "printed": {"wrong": guess},
        }
    else:
        wrong, printed = _bug(drawn.program, answer, drawn.question)
        code = {
            "right": drawn.program,
            "wrong": wrong,
            "blind": drawn.blind[0] if drawn.blind else None,
            "needs": drawn.needs,
            "difficulty": CODE_DIFFICULTY.get(family, drawn.difficulty),
            "printed": {
                "right": answer,
                "wrong": printed,
                "blind": drawn.blind[1] if drawn.blind else None,
            },
        }
    looks_up = drawn.query != drawn.question
    return {
        "difficulty": "exact" if family == "arithmetic" else drawn.difficulty,
        "evidence": evidence,
        "query": [drawn.query, drawn.decoy],
        "passages": (
            [world_passage(drawn.query), world_passage(drawn.decoy)] if looks_up else None
        ),
        "code": code,
    }


@dataclass(frozen=True)
class Writers:
    """The simulated experts behind the composites and what their calls cost besides."""

    experts: dict[str, SimulatedExpert]  # by tool
    prompts: dict[str, str]
    executor_usd: dict[str, float]

    @classmethod
    def of(cls, toolbox: Toolbox) -> Writers:
        composites = {name: toolbox.tools[name] for name in ORCHESTRA_TOOLS}
        experts = {name: tool.expert for name, tool in composites.items()}
        for name, expert in experts.items():
            if not isinstance(expert, SimulatedExpert):
                raise TypeError(
                    f"the {name} tool's expert is {type(expert).__name__}: the "
                    "offline oracle knows simulated experts only"
                )
        executor_usd = {
            name: (
                tool.executor.spec.pricing.cost(Usage(), tool.executor.spec.latency_hint_s)
                if hasattr(tool, "executor")
                else 0.0
            )
            for name, tool in composites.items()
        }
        return cls(experts, {name: tool.prompt for name, tool in composites.items()}, executor_usd)

    @property
    def sigma(self) -> float:
        """The largest spread of any writer's token counts (log-normal sigma)."""
        return max(
            model.output_tokens_sigma
            for expert in self.experts.values()
            for model in expert.models.values()
        )

    def aliases(self, tool: str) -> list[str]:
        return list(self.experts[tool].models)

    def by_price(self, tool: str) -> list[str]:
        """The tool's aliases, cheapest output first (declaration order among equals)."""
        pricing = self.experts[tool].pricing
        return sorted(pricing, key=lambda alias: pricing[alias].per_output_token)

    def usd(self, tool: str, alias: str, task: Task, observations: tuple[str, ...]) -> float:
        """The expected USD of one call: the writer's tokens (the prompt it is handed, its mean
        output) and the executor's fee."""
        expert = self.experts[tool]
        model = expert.models[alias]
        prompt = self.prompts[tool].format(
            question=task.question,
            context=context_text(ToolContext(observations=observations), model.max_context_tokens),
        )
        pricing = expert.pricing[alias]
        mean_output = model.mean_output_tokens * math.exp(model.output_tokens_sigma**2 / 2)
        return (
            pricing.per_input_token * (expert.prompt_overhead_tokens + len(prompt) // 4)
            + pricing.per_output_token * mean_output
            + self.executor_usd[tool]
        )


def routes(writers: Writers) -> dict[str, Route]:
    """Every route of up to :data:`MAX_CALLS` calls that ends with an answer, by name."""
    steps = [(tool, alias) for tool in WRITERS for alias in writers.aliases(tool)]
    found: dict[str, Route] = {}
    for length in range(MAX_CALLS):
        for prefix in itertools.product(steps, repeat=length):
            for alias in writers.aliases(ANSWER):
                calls = (*prefix, (ANSWER, alias))
                found[">".join(a for _, a in calls)] = tuple(
                    (tool, {"model": a}) for tool, a in calls
                )
    return found


def route_name(calls: Iterable[tuple[str, Mapping[str, Any]]]) -> str:
    """An episode's route: the aliases of its calls, in order."""
    return ">".join(str(arguments.get("model")) for _, arguments in calls)


def repeats_a_call(route: str) -> bool:
    """Whether a route (by name) asks one model twice: never better than the route without the
    repeat, which sees the same observations (a model asked again repeats its choice) for one
    turn less."""
    calls = route.split(">")
    return len(set(calls)) < len(calls)


def shape(route: Route) -> frozenset[str]:
    return frozenset(tool for tool, _ in route)


def _over_budget(mean_usd: float, budget: float, sigma: float) -> float:
    """The chance that a cost of mean ``mean_usd`` passes ``budget``, taking the cost as
    log-normal with the writers' largest token-count ``sigma`` (a sum of such draws spreads
    less, so this errs on the side of the budget)."""
    if mean_usd <= 0:
        return 0.0
    mu = math.log(mean_usd) - sigma**2 / 2
    return 0.5 * math.erfc((math.log(budget) - mu) / (sigma * math.sqrt(2)))


# One branch of a route's outcomes: its probability, the observations so far, the USD so far
# and what each writer drew (a model asked again in an episode repeats its choice).
_Branch = tuple[float, tuple[str, ...], float, tuple[tuple[str, str], ...]]


def _observe(tool: str, alias: str, task: Task, writers: Writers, branch: _Branch) -> list[_Branch]:
    """The branches after one writer's call (see the module docstring)."""
    probability, observations, usd, drawn = branch
    metadata, model = task.metadata, writers.experts[tool].models[alias]
    usd += writers.usd(tool, alias, task, observations)
    seen = fit_observations(observations, model.max_context_tokens)
    chances = writing_chances("query" if tool == SEARCH else "code", model, metadata, seen)
    before = dict(drawn).get(alias)
    if before in ("right", "wrong") and "blind" not in chances:
        chances = {before: 1.0}  # asked again, a model repeats its choice
    if tool == SEARCH:
        right, wrong = metadata["query"]
        passages = metadata["passages"] or ["", ""]  # a task with nothing to find: unrelated
        texts = {
            "right": f"Query:\n{right}\nResult:\n{passages[0]}",
            "wrong": f"Query:\n{wrong}\nResult:\n{passages[1]}",
        }
    else:
        code = metadata["code"]
        texts = {kind: f"Code:\n{code[kind]}\nResult:\n{code['printed'][kind]}" for kind in chances}
    return [
        (
            probability * p,
            (*observations, texts[kind]),
            usd,
            (*[(a, k) for a, k in drawn if a != alias], (alias, kind)),
        )
        for kind, p in chances.items()
        if p > 0
    ]


def route_values(
    task: Task, writers: Writers, orchestrator_usd_per_turn: float, usd_reference: float
) -> list[RouteValue]:
    """Expected accuracy, USD and utility of every route for the task's preference (the
    orchestrator paying ``orchestrator_usd_per_turn`` per call); a branch past the task's
    budget scores 0, as the reward scores it."""
    preference, budget = task.metadata["preference"], task.metadata.get("budget_usd")
    all_routes = routes(writers)
    prefixes: dict[tuple, list[_Branch]] = {(): [(1.0, (), 0.0, ())]}
    values = []
    for name, route in all_routes.items():
        *prefix, (_, answering) = route
        key = tuple((tool, arguments["model"]) for tool, arguments in prefix)
        if key not in prefixes:
            branches = prefixes[key[:-1]]
            prefixes[key] = [
                after for branch in branches for after in _observe(*key[-1], task, writers, branch)
            ]
        counts = {tool: sum(1 for t, _ in route if t == tool) for tool in shape(route)}
        expert, alias = writers.experts[ANSWER], answering["model"]
        model = expert.models[alias]
        accuracy = usd = value = 0.0
        for probability, observations, spent, _ in prefixes[key]:
            spent += writers.usd(
                ANSWER, alias, task, observations
            ) + orchestrator_usd_per_turn * len(route)
            level, unrelated = reading(
                task.metadata, fit_observations(observations, model.max_context_tokens)
            )
            right = model.accuracy_on(level) * model.distraction**unrelated
            if budget is not None:
                right *= 1 - _over_budget(spent, budget, writers.sigma)
            accuracy += probability * right
            usd += probability * spent
            value += probability * right * utility(preference, True, spent, counts, usd_reference)
        values.append(RouteValue(name, shape(route), accuracy, usd, value))
    return values


def _strongests_line(writers: Writers, tool: str) -> list[str]:
    """The aliases of the strongest model's line, the most expensive first (a line: the alias
    less its tier, so ``answer-1`` ... ``answer-4`` for ``answer``, not the math specialists)."""
    ranked = writers.by_price(tool)[::-1]
    line = ranked[0].rsplit("-", 1)[0]
    return [alias for alias in ranked if alias.rsplit("-", 1)[0] == line]


# The tier of the strongest's line the instructed rule takes for a stated preference: the
# cheapest for low cost, the one below the strongest for a balance of cost and accuracy or a
# budget; the strongest for anything else.
INSTRUCTED_TIERS = {"cost": -1, "neutral": 1, "budget": 1}


def naive_routes(
    tasks: list[Task], writers: Writers, router_shares: Mapping[str, float], seed: int
) -> dict[str, Route]:
    """The route each task's naive router takes (``router_shares`` over
    :data:`~nemo_orch.config.DEMO_ROUTERS`): ``strongest``, the family's tools with the most
    expensive model of each; ``instructed``, a keyword rule over the user's instruction that
    drops the tool an instruction forbids and takes the tier of the strongest's line that
    :data:`INSTRUCTED_TIERS` names for it (the cheapest, ``answer-4`` and not a math
    specialist, for low cost; the next below the strongest, ``answer-2``, for a balance or a
    budget), the strongest otherwise; ``tiered``, the family's tools all at one price tier of
    the strongest's line drawn for the route (the strongest, the next, ...; a tool with fewer
    tiers its cheapest);
    ``family``, the family's tools with models drawn at random; ``random``, any route. None
    knows the accuracies, and only the instructed rule reads the preference: what is best is
    left to RL. By task id."""
    rng = random.Random(seed)
    every = routes(writers)
    names = sorted(every)
    chosen = {}
    for task in tasks:
        router = rng.choices(DEMO_ROUTERS, [router_shares[name] for name in DEMO_ROUTERS])[0]
        tools = FAMILY_SHAPES[task.metadata["family"]]
        if router == "random":
            chosen[task.id] = every[rng.choice(names)]
            continue
        if router == "family":
            aliases = [rng.choice(writers.aliases(tool)) for tool in tools]
        elif router == "tiered":
            lines = [_strongests_line(writers, tool) for tool in tools]
            tier = rng.randrange(max(len(line) for line in lines))
            aliases = [line[min(tier, len(line) - 1)] for line in lines]
        else:
            stated = next(
                (
                    name
                    for name, phrases in PREFERENCE_PHRASES.items()
                    if task.metadata["instruction"] in phrases
                ),
                None,
            )
            if router == "instructed":
                forbidden = {
                    name.removeprefix("tool:")
                    for name, weight in PREFERENCE_VECTORS.get(stated, {}).items()
                    if weight < 0
                }
                tools = tuple(tool for tool in tools if tool not in forbidden)
            tier = INSTRUCTED_TIERS.get(stated) if router == "instructed" else None
            aliases = [
                writers.by_price(tool)[-1]
                if tier is None
                else _strongests_line(writers, tool)[tier]
                for tool in tools
            ]
        chosen[task.id] = tuple((tool, {"model": alias}) for tool, alias in zip(tools, aliases))
    return chosen
