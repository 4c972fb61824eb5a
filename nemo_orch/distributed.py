"""Process group and Megatron parallel state: the one place that initializes them.

Works under ``torchrun`` (reads RANK/WORLD_SIZE/MASTER_ADDR/...) and as a plain single process
(a world of one on 127.0.0.1). Uses NCCL with CUDA and gloo otherwise.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_orch.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    parallel: ParallelConfig

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.parallel.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize(parallel: ParallelConfig, seed: int) -> ParallelContext:
    """Start the process group and Megatron's model-parallel groups, and seed every RNG."""
    from megatron.core import parallel_state, tensor_parallel

    from nemo_orch.models import cpu_compat

    cpu_compat.apply()
    if not dist.is_initialized():
        launched = "RANK" in os.environ  # torchrun (or another launcher) set up the world
        world_size = int(os.environ["WORLD_SIZE"]) if launched else 1
        if world_size != parallel.world_size:
            raise ConfigError(
                f"parallel.tp * parallel.pp * parallel.dp = {parallel.world_size} but "
                f"{world_size} process(es) were launched"
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if launched:
            dist.init_process_group(backend=backend)
        else:  # a plain single process: a world of one on loopback, environment untouched
            dist.init_process_group(
                backend=backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}"
            )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        parallel=parallel,
    )


def shutdown() -> None:
    from megatron.core import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextmanager
def parallel_session(parallel: ParallelConfig, seed: int) -> Iterator[ParallelContext]:
    context = initialize(parallel, seed)
    try:
        yield context
    finally:
        shutdown()


def set_intra_op_threads(requested: int) -> int:
    """Set torch's intra-op threads: ``requested``, or with 0 the CPUs this process may run on
    shared evenly by the ranks of this machine (torchrun's ``LOCAL_WORLD_SIZE``): all of them
    for a single process, one each when as many ranks as CPUs share them. Returns the count."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = requested or max(1, len(os.sched_getaffinity(0)) // ranks_here)
    torch.set_num_threads(threads)
    # torch keeps one count for the process, and each OpenMP worker of this thread's pool takes
    # it once, at its first reduction. A thread that later sets its own (the CPU engine's, one)
    # would give it to workers that start after that, and MKL rounds their blocks of a kernel
    # differently from the others' (a resumed GRPO parted from the uninterrupted one in the 9th
    # digit). A reduction split over every thread makes each take this count now: ATen splits
    # one only in chunks of at least 32,768 elements, so each thread gets 65,536 (256 KB).
    torch.zeros(threads * 512, 128).sum(-1)
    return threads


def is_writer() -> bool:
    """Whether this process writes shared files (global rank 0, or no process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
