from nemo_orch.envs.offline.environment import OfflineEnvironment

__all__ = ["OfflineEnvironment"]
