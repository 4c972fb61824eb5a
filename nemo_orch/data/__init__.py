"""File formats: tasks, conversations, row files (JSONL, JSON, parquet), domains and their task
schema, SFT samples. Where tasks come from is :mod:`nemo_orch.envs`."""
