"""How far the oracle's route is ahead of the next best, per (family, preference) group of the
offline world, and how many episodes of each route GRPO would need to tell them apart.

``python scripts/route_margins.py [--tasks N] [--episodes E]`` prints a Markdown table: each
group's share of the tasks, the oracle's route, the best other route that does not repeat a call
(a repeated call is never better: the margin to it is the cost of one more call) and the margin
between their expected utilities, averaged over the group's tasks; the episodes of each route a
comparison needs to see that margin at two standard errors (the episode's utility varies as its
answer is right or wrong: sd ~ sqrt(p (1 - p)) for the route's accuracy p); and the group's
episodes in a GRPO run of ``E`` episodes (the main job: 40 steps x 8 tasks x 8 episodes).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter, defaultdict

from nemo_orch import config as config_lib
from nemo_orch.envs.offline import orchestra
from nemo_orch.envs.offline.world import ORCHESTRA, make_tasks
from nemo_orch.rollout.builders import build_toolbox

# The oracle's per-turn price of the policy's own tokens and its cost weight, as the main job's
# evaluation uses them (tests/envs/test_offline_orchestra.py).
PER_TURN_USD, COST_WEIGHT = 5e-5, 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--episodes", type=int, default=40 * 8 * 8)
    args = parser.parse_args()
    writers = orchestra.Writers.of(build_toolbox(config_lib.load().tools))
    tasks = make_tasks(args.tasks, seed=3, interface=ORCHESTRA)
    groups = defaultdict(list)
    for task in tasks:
        ranked = sorted(
            orchestra.route_values(task, writers, PER_TURN_USD, COST_WEIGHT),
            key=lambda value: -value.utility,
        )
        rival = next(value for value in ranked[1:] if not orchestra.repeats_a_call(value.route))
        groups[task.metadata["family"], task.metadata["preference_name"]].append((ranked[0], rival))
    print(
        "| group | share of tasks | oracle route | best other route | margin | episodes of "
        "each to tell them apart | the group's episodes in the run |"
    )
    print("|---|---:|---|---|---:|---:|---:|")
    for (family, preference), rows in sorted(groups.items()):
        oracle = Counter(top.route for top, _ in rows).most_common(1)[0][0]
        rival = Counter(other.route for _, other in rows).most_common(1)[0][0]
        margin = statistics.mean(top.utility - other.utility for top, other in rows)
        accuracy = statistics.mean(top.accuracy for top, _ in rows)
        spread = math.sqrt(max(accuracy * (1 - accuracy), 0.01))
        needed = 2 * (2 * spread / max(margin, 1e-4)) ** 2
        share = len(rows) / len(tasks)
        print(
            f"| {family}/{preference} | {share:.3f} | `{oracle}` | `{rival}` | {margin:.3f} | "
            f"{needed:,.0f} | {share * args.episodes:,.0f} |"
        )


if __name__ == "__main__":
    main()
