from nemo_orch.envs.toolscale.environment import (
    LoadedDomain,
    ToolScaleEnvironment,
    load_rows,
    toolscale_gold_plan,
)

__all__ = ["LoadedDomain", "ToolScaleEnvironment", "load_rows", "toolscale_gold_plan"]
