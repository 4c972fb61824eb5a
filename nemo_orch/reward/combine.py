"""One scalar reward per trajectory of a group, from its features (``reward.combination``).

``toolorchestra``: a wrong answer scores 0; a right one scores
``sum_f |w_f| * minmax_group(sign(w_f) * x_f)`` over the task's preference vector ``w``, with
``x_accuracy = outcome``, ``x_cost = -usd``, ``x_latency = -seconds`` and ``x_tool:<name>`` /
``x_model:<alias>`` = call count. Cost and latency are negated both in the normalization and in
the score (the reference normalizes ``-cost`` and then scores ``+cost``, rewarding expense). For
positive weights this is ``sum_f w_f * minmax(x_f)``; a negative weight (avoid a tool) scores the
flipped direction with weight ``|w_f|``, so a right answer never scores below a wrong one. The
min-max runs over the whole group, right or wrong; a feature that is constant over the group
normalizes to 1 (everyone is as good as the best), so a group of equal right answers gets equal
rewards ``sum_f |w_f|``.

``weighted`` (GDPO-style): ``sum_c w_c * (x_c - mean_group(x_c)) / (std_group(x_c) + eps)`` over
``reward.weights`` components ``outcome``, ``cost`` (-usd), ``latency`` (-seconds) and
``preference`` (preference match), each baselined on its own.

``linear``: ``alpha * outcome - beta * usd / usd_reference - gamma * seconds / seconds_reference
+ delta * preference_match``.

``preference``: a wrong answer scores 0; a right one scores the task's preference vector on a
fixed scale instead of the group's min-max: ``max(0, w_accuracy - w_cost * usd / usd_reference
- w_latency * seconds / seconds_reference + sum over calls w * [called])`` (the offline world's
utility). Min-max normalization stretches whatever spread a group has to [0, 1], so a group whose
routes all cost the same ranks its samples by token-count noise; a fixed scale keeps a route's
cost where it is.

Each breakdown carries every component on its own (``term:<name>`` is a term's contribution to
the reward), so a logger can show what moved.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nemo_orch.config import RewardConfig
from nemo_orch.data.tasks import Task
from nemo_orch.reward.components import (
    CALL_PREFIXES,
    Features,
    extract_features,
    preference_match,
    preference_terms,
    task_preference,
)
from nemo_orch.reward.outcome import OUTCOME_METHODS, OutcomeResult
from nemo_orch.rollout.trajectory import Trajectory

# weighted: how each component of reward.weights is read from a trajectory's features.
WEIGHTED_COMPONENTS: dict[str, Callable[[Features, dict[str, float]], float]] = {
    "outcome": lambda f, _: f.outcome,
    "cost": lambda f, _: -f.usd,
    "latency": lambda f, _: -f.seconds,
    "preference": preference_match,
}


@dataclass(frozen=True)
class RewardBreakdown:
    """A trajectory's reward and the components it was computed from (all floats, for logs)."""

    reward: float
    components: dict[str, float]


def _preference_value(features: Features, name: str) -> float:
    """``x_f`` of the toolorchestra combination: larger is better for a positive weight."""
    if name == "accuracy":
        return features.outcome
    if name == "cost":
        return -features.usd
    if name == "latency":
        return -features.seconds
    return float(features.calls.get(name, 0))


def _minmax(values: Sequence[float]) -> list[float]:
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    return [(value - low) / (high - low) for value in values]


def _standardize(values: Sequence[float], eps: float) -> list[float]:
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    return [(value - mean) / (std + eps) for value in values]


def _toolorchestra(
    features: list[Features], preference: dict[str, float], config: RewardConfig
) -> list[dict[str, float]]:
    terms: list[dict[str, float]] = [{} for _ in features]
    for name, weight in preference.items():
        sign = 1.0 if weight >= 0 else -1.0
        normalized = _minmax([sign * _preference_value(f, name) for f in features])
        for term, f, value in zip(terms, features, normalized):
            term[f"term:{name}"] = abs(weight) * value if f.outcome else 0.0
    return terms


def _weighted(
    features: list[Features], preference: dict[str, float], config: RewardConfig
) -> list[dict[str, float]]:
    unknown = config.weights.keys() - WEIGHTED_COMPONENTS.keys()
    if unknown:
        raise ValueError(
            f"reward.weights has unknown components {sorted(unknown)}; "
            f"known: {sorted(WEIGHTED_COMPONENTS)}"
        )
    terms: list[dict[str, float]] = [{} for _ in features]
    for name, weight in config.weights.items():
        read = WEIGHTED_COMPONENTS[name]
        baselined = _standardize([read(f, preference) for f in features], config.advantage_eps)
        for term, value in zip(terms, baselined):
            term[f"term:{name}"] = weight * value
    return terms


def _linear(
    features: list[Features], preference: dict[str, float], config: RewardConfig
) -> list[dict[str, float]]:
    return [
        {
            "term:outcome": config.linear_alpha * f.outcome,
            "term:cost": -config.linear_beta * f.usd / config.usd_reference,
            "term:latency": -config.linear_gamma * f.seconds / config.seconds_reference,
            "term:preference": config.linear_delta * preference_match(f, preference),
        }
        for f in features
    ]


def _preference(
    features: list[Features], preference: dict[str, float], config: RewardConfig
) -> list[dict[str, float]]:
    return [
        {
            f"term:{name}": value
            for name, value in preference_terms(
                preference,
                f.outcome > 0,
                f.usd,
                f.seconds,
                f.calls,
                config.usd_reference,
                config.seconds_reference,
            ).items()
        }
        for f in features
    ]


COMBINATIONS: dict[
    str, Callable[[list[Features], dict[str, float], RewardConfig], list[dict[str, float]]]
] = {
    "toolorchestra": _toolorchestra,
    "weighted": _weighted,
    "linear": _linear,
    "preference": _preference,
}


def score_group(
    task: Task,
    trajectories: Sequence[Trajectory],
    outcomes: Sequence[OutcomeResult],
    config: RewardConfig,
) -> list[RewardBreakdown]:
    """The rewards of one task's group (``outcomes[i]`` judges ``trajectories[i]``'s answer)."""
    if len(trajectories) != len(outcomes):
        raise ValueError(f"{len(trajectories)} trajectories but {len(outcomes)} outcomes")
    if not trajectories:
        return []
    preference = task_preference(task)
    features = [extract_features(task, t, o) for t, o in zip(trajectories, outcomes)]
    terms = COMBINATIONS[config.combination](features, preference, config)
    call_keys = sorted(
        {key for f in features for key in f.calls}
        | {key for key in preference if key.startswith(CALL_PREFIXES)}
    )
    breakdowns = []
    for f, term in zip(features, terms):
        reward = sum(term.values())
        components = {
            "reward": reward,
            "outcome": f.outcome,
            "usd": f.usd,
            "seconds": f.seconds,
            "preference_match": preference_match(f, preference),
            "format_errors": float(f.format_errors),
            "answered": float(f.answered),
            "over_budget": float(f.over_budget),
            **{f"outcome_method:{m}": float(f.method == m) for m in OUTCOME_METHODS},
            **{key: float(f.calls.get(key, 0)) for key in call_keys},
            **term,
        }
        breakdowns.append(RewardBreakdown(reward, components))
    return breakdowns
