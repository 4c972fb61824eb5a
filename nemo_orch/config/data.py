"""``data.*``: SFT's data, and the agent kinds that play demonstrations and evaluations."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from nemo_orch.config.base import _require, _require_file

# The naive routers that play the main job's demonstrations (envs.offline.world.naive_routes).
DEMO_ROUTERS = ("strongest", "instructed", "tiered", "family", "random")
# The systems an evaluation runs and SFT collects demonstrations from (eval/agents.py).
ORCHESTRATOR, MONOLITH, GOLD_REPLAY = "orchestrator", "monolith", "gold-replay"
NAIVE_ROUTERS = "naive-routers"
ROUTERS = ("fixed:cheapest", "fixed:strongest", "random")
AGENT_KINDS = (ORCHESTRATOR, MONOLITH, *ROUTERS, GOLD_REPLAY, NAIVE_ROUTERS)


@dataclass
class DataConfig:
    """SFT's data. ``sft_path``: a JSONL file of conversations (``{"messages": [...], "tools":
    [...]}``); null: demonstrations, the episodes of ``demo_agent`` (:data:`AGENT_KINDS`: a
    fixed router, the gold replay, the orchestrator of ``rollout.*``, a checkpoint, HF
    directory or endpoint, the monolith, or the offline world's naive routers) on
    ``2 * num_offline_conversations`` tasks of ``env``'s train split that the environment
    scores correct, the first ``num_offline_conversations`` of them, collected once into
    ``<run>/demonstrations.jsonl``. A tokenizer trained for the run learns the file's
    conversations, or ``num_offline_conversations`` of ``env``'s own (the offline world's
    generated ones; another environment's task prompts). ``num_copy_conversations`` short
    copy-into-the-answer conversations of ``env`` are mixed in (the offline world has them;
    0: none). ``demo_routers``: the share of the tasks each naive router (:data:`DEMO_ROUTERS`)
    plays; they sum to 1.
    ``toolscale_tasks_per_domain``: the main job writes the offline ToolScale domains with that
    many tasks each (``toolscale/`` in the run) and evaluates the GRPO policy, next to the gold
    replay, on the first ``toolscale_eval_tasks`` of each (0: neither)."""

    sft_path: Optional[str] = None
    demo_agent: str = NAIVE_ROUTERS
    num_offline_conversations: int = 2000
    num_copy_conversations: int = 0
    # SFT's sequence length: longer conversations are dropped and counted, not truncated.
    seq_length: int = 640
    demo_routers: dict[str, float] = field(
        default_factory=lambda: {
            "strongest": 0.1,
            "instructed": 0.5,
            "tiered": 0.0,
            "family": 0.25,
            "random": 0.15,
        }
    )
    toolscale_tasks_per_domain: int = 200
    toolscale_eval_tasks: int = 20
    # Keep a correct demonstration only if its route serves the task's preference at least this
    # well (the environment's preference adherence: the route's expected utility over the best
    # route's; where the environment knows no best route, every correct one). 0: every correct
    # episode.
    demo_min_adherence: float = 0.0

    def __post_init__(self) -> None:
        _require_file(self.sft_path, "data.sft_path")
        _require(
            self.demo_agent in AGENT_KINDS,
            f"data.demo_agent must be one of {', '.join(AGENT_KINDS)}",
        )
        _require(self.num_offline_conversations > 0, "data.num_offline_conversations must be > 0")
        _require(self.num_copy_conversations >= 0, "data.num_copy_conversations must be >= 0")
        _require(self.seq_length > 8, "data.seq_length must be > 8")
        _require(
            set(self.demo_routers) == set(DEMO_ROUTERS),
            f"data.demo_routers must give a share to each of {', '.join(DEMO_ROUTERS)}",
        )
        _require(
            all(share >= 0 for share in self.demo_routers.values())
            and math.isclose(sum(self.demo_routers.values()), 1.0),
            "data.demo_routers: shares must be >= 0 and sum to 1",
        )
        _require(0 <= self.demo_min_adherence <= 1, "data.demo_min_adherence must be in [0, 1]")
        _require(
            0 <= self.toolscale_eval_tasks <= self.toolscale_tasks_per_domain,
            "data.toolscale_eval_tasks must be in [0, data.toolscale_tasks_per_domain]",
        )
