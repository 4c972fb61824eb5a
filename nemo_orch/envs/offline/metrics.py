"""The offline world's own metrics of a training step (:meth:`OfflineEnvironment.rollout_metrics`):
the routes its episodes took, over all and per (family, preference) group, so a collapse onto
one shortcut shows while it happens; and where the step's learning signal is.

* ``route/<route>``: each route's share of the episodes;
* ``group/<family>/<preference>/reward`` and ``.../route/<route>``: per group, the mean reward
  and each route's share;
* ``group/<family>/<preference>/flat`` and ``.../one_route`` (``signal/flat``,
  ``signal/one_route`` over all): the share of the tasks' groups whose rewards are all equal (no
  signal) and whose episodes all took one route (no signal about the route, whatever the
  rewards);
* ``signal/advantage_share/<preference>``: each preference's share of the trained groups'
  advantage mass (the sum of |advantage|): advantages do not depend on the batch's mix, but the
  update's direction is their sum.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence

from nemo_orch.envs.interfaces import EpisodeGroup
from nemo_orch.envs.offline.oracle import group_key, route_of, route_shares


def rollout_metrics(groups: Sequence[EpisodeGroup]) -> dict[str, float]:
    """The metrics above of a step's ``groups`` (every one generated)."""
    routes = [[route_of(trajectory) for trajectory in group.trajectories] for group in groups]
    episodes = [
        (group.task, route, reward)
        for group, group_routes in zip(groups, routes)
        for route, reward in zip(group_routes, group.rewards)
    ]
    if not episodes:
        return {}
    counts = Counter(route for _, route, _ in episodes)
    metrics = {f"route/{name}": count / len(episodes) for name, count in counts.items()}
    rewards: dict[str, list[float]] = defaultdict(list)
    for task, _, reward in episodes:
        rewards[group_key(task)].append(reward)
    metrics.update(
        {f"group/{key}/reward": statistics.mean(values) for key, values in rewards.items()}
    )
    shares = route_shares([task for task, _, _ in episodes], [route for _, route, _ in episodes])
    for key, by_route in shares.items():
        metrics.update({f"group/{key}/route/{name}": share for name, share in by_route.items()})
    return {**metrics, **_signal_metrics(groups, routes)}


def _signal_metrics(groups: Sequence[EpisodeGroup], routes: list[list[str]]) -> dict[str, float]:
    flat: dict[str, list[float]] = defaultdict(list)
    one_route: dict[str, list[float]] = defaultdict(list)
    for group, group_routes in zip(groups, routes):
        if not group.rewards:
            continue
        rewards_alike = float(len(set(group.rewards)) == 1)
        routes_alike = float(len(set(group_routes)) == 1)
        for key in (f"group/{group_key(group.task)}", "signal"):
            flat[key].append(rewards_alike)
            one_route[key].append(routes_alike)
    metrics = {f"{key}/flat": statistics.mean(values) for key, values in flat.items()}
    metrics.update(
        {f"{key}/one_route": statistics.mean(values) for key, values in one_route.items()}
    )
    mass: Counter = Counter()
    for group in groups:
        if group.advantages is not None:
            mass[group.task.metadata["preference_name"]] += sum(abs(a) for a in group.advantages)
    total = sum(mass.values())
    metrics.update(
        {
            f"signal/advantage_share/{name}": value / total
            for name, value in sorted(mass.items())
            if total > 0
        }
    )
    return metrics
