"""The training stages: SFT, GRPO/PPO, DPO and the main job that runs them in turn."""
