"""The GRPO curriculum: stages by step or reward, resumable from the metrics log."""

from __future__ import annotations

import math

import pytest

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError, CurriculumStage
from nemo_orch.train.curriculum import check_tools, stage_index, stage_tools

STAGES = [
    CurriculumStage(tools=["search", "python_sandbox"], until_step=3),
    CurriculumStage(tools=["search", "python_sandbox", "call_expert"], until_reward=0.5),
    CurriculumStage(),
]


def test_stages_advance_by_step_then_by_reward():
    assert stage_index(STAGES, []) == 0
    assert stage_index(STAGES, [0.9, 0.9]) == 0  # until_step=3: rewards do not count
    assert stage_index(STAGES, [0.0, 0.0, 0.0]) == 1
    assert stage_index(STAGES, [0.0, 0.0, 0.0, 0.4, math.nan]) == 1
    assert stage_index(STAGES, [0.0, 0.0, 0.0, 0.4, 0.6]) == 2
    assert stage_index(STAGES, [0.0] * 3 + [0.6] * 10) == 2  # the last stage stays
    assert stage_tools(STAGES, [0.0]) == ["search", "python_sandbox"]
    assert stage_tools(STAGES, [0.0] * 3 + [0.6]) is None
    assert stage_tools([], [0.0]) is None


def test_stage_validation():
    loaded = config_lib.load(["grpo.curriculum=[{tools:[search],until_step:2},{}]"])
    assert loaded.grpo.curriculum == [
        CurriculumStage(tools=["search"], until_step=2),
        CurriculumStage(),
    ]
    with pytest.raises(ConfigError, match=r"grpo.curriculum\[1\]: every stage but the last"):
        config_lib.load(["grpo.curriculum=[{until_step:2},{until_step:4}]"])
    with pytest.raises(ConfigError, match=r"grpo.curriculum\[0\]: every stage but the last"):
        config_lib.load(["grpo.curriculum=[{tools:[search]},{}]"])
    with pytest.raises(ConfigError, match=r"grpo.curriculum\[0\].tools: web not declared"):
        check_tools([CurriculumStage(tools=["web"], until_step=1), CurriculumStage()], ["search"])
