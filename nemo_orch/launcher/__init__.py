"""Launching on a cluster: ``nemo-orch plan`` (layout checks and per-GPU memory, on CPU) and
``nemo-orch launch`` (NeMo-Run: the training job, expert servers and a Ray cluster on SLURM with
pyxis/Enroot containers, or the training job under torchrun on this machine)."""
