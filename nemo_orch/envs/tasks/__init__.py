from nemo_orch.envs.tasks.environment import TaskFileEnvironment

__all__ = ["TaskFileEnvironment"]
