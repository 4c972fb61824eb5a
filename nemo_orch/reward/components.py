"""What a reward is computed from: one trajectory's features, and the task's preference vector.

A preference vector (``task.metadata["preference"]``) weighs the features ``accuracy``, ``cost``,
``latency`` and call counts ``tool:<name>`` / ``model:<alias>``; a negative weight on a call count
means "avoid it", a positive one "use it". The same vector yields the natural-language instruction
the policy reads after the question (:func:`preference_instruction`): the training tasks and the
served orchestrator state it with the one function, so what the policy is told is what it was
trained on, and what it is rewarded for.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_orch.data.tasks import Task
from nemo_orch.reward.outcome import OutcomeResult
from nemo_orch.rollout.trajectory import Termination, Trajectory

BASE_PREFERENCES = ("accuracy", "cost", "latency")
CALL_PREFIXES = ("tool:", "model:")
DEFAULT_PREFERENCE: dict[str, float] = {"accuracy": 1.0}
# How each kind of preference is said: several phrasings each, so a small policy learns what they
# mean rather than one string.
PREFERENCE_PHRASES: dict[str, tuple[str, ...]] = {
    "cost": (
        "Keep the cost low.",
        "Minimize cost: use the cheapest tool that works.",
        "The budget is tight, so prefer cheap tools.",
    ),
    # No word is shared with the cost phrases: a tiny policy tells them apart by their words.
    "accuracy": (
        "Accuracy matters most.",
        "Get it right, whatever it takes.",
        "Use the strongest model available when in doubt.",
    ),
    "no_search": (
        "Do not use web search.",
        "Web search is not allowed for this task.",
        "Do not search.",
    ),
    "neutral": ("Answer concisely.", "Be brief.", "Only the final answer is graded."),
    "no_code": ("Do not run code.", "Code execution is not allowed for this task."),
    # Said with a budget the task states (``budget_usd``).
    "budget": ("Stay within the budget.", "Do not go over the budget."),
}
# Calls whose avoidance has phrasings of its own.
_AVOIDED_CALL_PHRASES = {
    "tool:python_sandbox": "no_code",
    "tool:enhance_reasoning": "no_code",
    "tool:web_search": "no_search",
    "tool:search": "no_search",
}


def preference_terms(
    preference: Mapping[str, float],
    correct: bool,
    usd: float,
    seconds: float,
    calls: Mapping[str, int],
    usd_reference: float,
    seconds_reference: float,
) -> dict[str, float]:
    """Each feature's term of the preference vector on a fixed scale: all 0 if wrong, else
    ``w_accuracy``, ``-w_cost * usd / usd_reference``, ``-w_latency * seconds /
    seconds_reference`` and ``w * [called]`` per ``tool:``/``model:`` feature (``calls``: counts
    by those keys), and a ``floor`` that lifts a right answer's sum to 0 when its costs and
    avoided calls outweigh it: a right answer never scores below a wrong one (else a policy
    learns to fail where answering is dear). Their sum is the offline world's utility and the
    ``preference`` reward."""
    terms = {}
    for name, weight in preference.items():
        if name == "accuracy":
            value = weight
        elif name == "cost":
            value = -weight * usd / usd_reference
        elif name == "latency":
            value = -weight * seconds / seconds_reference
        else:
            value = weight * float(calls.get(name, 0) > 0)
        terms[name] = value if correct else 0.0
    terms["floor"] = max(0.0, -sum(terms.values()))
    return terms


@dataclass(frozen=True)
class Features:
    """One trajectory, as rewards see it.

    ``outcome`` is 0 when the episode went over the task's budget (``over_budget``) even if the
    answer was right. ``calls`` counts ``tool:<name>`` and ``model:<alias>`` over every call the
    policy made, failed ones included: the preference is about what the policy chose to call.
    """

    outcome: float
    usd: float
    seconds: float
    format_errors: int
    answered: bool
    over_budget: bool
    method: str
    calls: dict[str, int] = field(default_factory=dict)


def extract_features(task: Task, trajectory: Trajectory, outcome: OutcomeResult) -> Features:
    """The features of ``trajectory``; ``task.metadata["budget_usd"]`` caps its cost (an episode
    ended for its budget, termination ``budget``, is over it too)."""
    usd = trajectory.cost_usd
    budget = task.metadata.get("budget_usd")
    over_budget = trajectory.termination == Termination.BUDGET or (
        budget is not None and usd > budget
    )
    calls: Counter[str] = Counter()
    for turn in trajectory.turns:
        for call in turn.calls:
            if call.tool is None:
                continue
            calls[f"tool:{call.tool}"] += 1
            model = (call.arguments or {}).get("model")
            if isinstance(model, str):
                calls[f"model:{model}"] += 1
    return Features(
        outcome=float(outcome.correct and not over_budget),
        usd=usd,
        seconds=trajectory.tool_seconds + trajectory.generation_seconds,
        format_errors=sum(trajectory.format_errors.values()),
        answered=bool((trajectory.answer or "").strip()),
        over_budget=over_budget,
        method=outcome.method,
        calls=dict(calls),
    )


def task_preference(task: Task) -> dict[str, float]:
    """The task's checked preference vector, :data:`DEFAULT_PREFERENCE` when it has none."""
    return check_preference(task.metadata.get("preference", DEFAULT_PREFERENCE))


def check_preference(preference: Any) -> dict[str, float]:
    """``preference`` as a ``{feature: weight}`` dict; a ValueError names what is malformed."""
    if not isinstance(preference, Mapping):
        raise ValueError(f"a preference must be an object of feature weights, got {preference!r}")
    checked = {}
    for key, weight in preference.items():
        if not (
            key in BASE_PREFERENCES
            or (isinstance(key, str) and key.startswith(CALL_PREFIXES) and key.split(":", 1)[1])
        ):
            raise ValueError(
                f"unknown preference feature {key!r}: use {BASE_PREFERENCES} or "
                f"tool:<name> / model:<alias>"
            )
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"preference weight of {key!r} must be a number, got {weight!r}")
        checked[key] = float(weight)
    return checked


def preference_match(features: Features, preference: Mapping[str, float]) -> float:
    """The share of the vector's call constraints the trajectory respects: an avoided (negative
    weight) tool or model never called, a wanted (positive weight) one called at least once.
    1.0 when the vector constrains no calls."""
    constraints = [
        (key, weight)
        for key, weight in preference.items()
        if key.startswith(CALL_PREFIXES) and weight != 0
    ]
    if not constraints:
        return 1.0
    respected = sum((features.calls.get(key, 0) > 0) == (weight > 0) for key, weight in constraints)
    return respected / len(constraints)


def preference_instruction(
    preference: Mapping[str, float], rng: random.Random | None = None
) -> str:
    """The instruction that tells the policy what ``preference`` rewards: one sentence per
    constraint in a fixed order (cost against accuracy, latency, then calls by name), each in a
    phrasing of :data:`PREFERENCE_PHRASES` where there is one (the first, or one drawn with
    ``rng``) and composed otherwise. Accuracy is stated only when nothing else is."""
    preference = check_preference(preference)

    def phrase(kind: str) -> str:
        phrasings = PREFERENCE_PHRASES[kind]
        return rng.choice(phrasings) if rng is not None else phrasings[0]

    accuracy, cost = preference.get("accuracy", 0.0), preference.get("cost", 0.0)
    sentences = []
    if cost > 0:
        sentences.append(phrase("cost" if cost >= accuracy else "neutral"))
    if preference.get("latency", 0.0) > 0:
        sentences.append("Answer quickly.")
    for key in sorted(k for k in preference if k.startswith(CALL_PREFIXES)):
        kind, name = key.split(":", 1)
        noun = "tool" if kind == "tool" else "model"
        if preference[key] < 0:
            sentences.append(
                phrase(_AVOIDED_CALL_PHRASES[key])
                if key in _AVOIDED_CALL_PHRASES
                else f"Do not use the {name} {noun}."
            )
        elif preference[key] > 0:
            sentences.append(f"Use the {name} {noun}.")
    if not sentences and accuracy > 0:
        sentences.append(phrase("accuracy"))
    return " ".join(sentences)
