from nemo_orch.envs.qa.environment import QAEnvironment

__all__ = ["QAEnvironment"]
