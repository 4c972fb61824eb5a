from nemo_orch.envs.tau2.environment import Tau2Environment, tau2_gold_plan

__all__ = ["Tau2Environment", "tau2_gold_plan"]
