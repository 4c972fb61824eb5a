"""Rewards of a finished group of trajectories of one task: each trajectory's scalar and the
components it came from, so every component can be logged.

``outcome`` decides right or wrong (exact, numeric, LLM judge, database state), in process or on
a reward server (``remote``), as ``builders.build_scorer`` picks from the config; ``components``
extracts cost, latency, call counts and preference adherence; ``combine`` turns a group into
rewards (``reward.combination``); ``advantages`` turns rewards into GRPO advantages and filters
groups; ``scoring`` runs it all over a batch.
"""

from nemo_orch.reward.advantages import (
    SamplingStats,
    fill_batch,
    group_advantages,
    group_drop_reason,
    step_advantages,
    trajectory_drop_reason,
)
from nemo_orch.reward.combine import RewardBreakdown, score_group
from nemo_orch.reward.components import (
    Features,
    extract_features,
    preference_instruction,
    preference_match,
    task_preference,
)
from nemo_orch.reward.outcome import (
    OUTCOME_METHODS,
    OutcomeResult,
    OutcomeScorer,
    exact_match,
    normalize_answer,
    numeric_match,
)
from nemo_orch.reward.scoring import ScoredGroup, by_answer, infra_failure, score_groups

__all__ = [
    "OUTCOME_METHODS",
    "Features",
    "OutcomeResult",
    "OutcomeScorer",
    "RewardBreakdown",
    "SamplingStats",
    "ScoredGroup",
    "by_answer",
    "exact_match",
    "extract_features",
    "fill_batch",
    "group_advantages",
    "group_drop_reason",
    "infra_failure",
    "normalize_answer",
    "numeric_match",
    "preference_instruction",
    "preference_match",
    "score_group",
    "score_groups",
    "step_advantages",
    "task_preference",
    "trajectory_drop_reason",
]
