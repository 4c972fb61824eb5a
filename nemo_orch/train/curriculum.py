"""The GRPO curriculum: stages that widen the tools tasks offer, advanced by step or reward.

The stage of a step is a pure function of the mean rewards of the steps before it, so a resumed
run, which reads them back from ``metrics.jsonl``, is in the same stage as an uninterrupted one.
"""

from __future__ import annotations

from nemo_orch.config import ConfigError, CurriculumStage


def stage_index(stages: list[CurriculumStage], rewards: list[float]) -> int:
    """The stage of the step after those whose mean rewards are ``rewards`` (step k's at
    index k - 1; NaN where a step had no episodes)."""
    index = 0
    for step, reward in enumerate(rewards, start=1):
        if index >= len(stages) - 1:
            break
        stage = stages[index]
        if (stage.until_step is not None and step >= stage.until_step) or (
            stage.until_reward is not None and reward >= stage.until_reward
        ):
            index += 1
    return index


def stage_tools(stages: list[CurriculumStage], rewards: list[float]) -> list[str] | None:
    """The tools of the next step's stage (None: all)."""
    return stages[stage_index(stages, rewards)].tools if stages else None


def check_tools(stages: list[CurriculumStage], declared: list[str]) -> None:
    for index, stage in enumerate(stages):
        unknown = sorted(set(stage.tools or ()) - set(declared))
        if unknown:
            raise ConfigError(
                f"grpo.curriculum[{index}].tools: {', '.join(unknown)} not "
                f"declared (declared: {', '.join(declared)})"
            )
