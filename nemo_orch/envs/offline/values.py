"""What a route is worth in the offline world: the preference utility of an episode, and a
route's expected accuracy, USD and utility (the oracle's unit), whatever the tool interface."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nemo_orch.reward.components import preference_terms


def utility(
    preference: Mapping[str, float],
    correct: bool,
    usd: float,
    tool_counts: Mapping[str, int],
    usd_reference: float,
) -> float:
    """The absolute, preference-weighted utility of one episode (``tool_counts`` by tool name):
    0 if wrong, else ``max(0, w_accuracy - w_cost * usd / usd_reference + sum over tool
    features w * [called])``, the ToolOrchestra reward with the group normalization replaced by
    a fixed cost scale (:func:`~nemo_orch.reward.components.preference_terms`)."""
    calls = {f"tool:{name}": count for name, count in tool_counts.items()}
    return sum(preference_terms(preference, correct, usd, 0.0, calls, usd_reference, 1.0).values())


@dataclass(frozen=True)
class RouteValue:
    """A route's expectations; its ``shape`` is the set of tools it calls."""

    route: str
    shape: frozenset[str]
    accuracy: float
    usd: float
    utility: float


def best(values: list[RouteValue]) -> RouteValue:
    return max(values, key=lambda value: value.utility)
