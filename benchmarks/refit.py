"""Refit cost: the trained policy's weights from its Megatron shards to full HF tensors on rank 0.

What it measures, per model size (tiny, micro, and a ~124M-parameter Qwen3) and layout (one
process; TP=2 over two gloo processes), each ``--repeats`` times:

* **pickled gather**: how the refit worked before its buckets (every rank's whole state dict
  pickled through ``all_gather_object`` onto every rank, then mapped to HF on rank 0);
* **bucketed gather**: :func:`nemo_orch.models.weights.gather_hf_weights`, the full HF dict on
  rank 0 built from buckets of ``--bucket-mb`` (what GRPO hands its engine today);
* **bucketed stream**: :func:`~nemo_orch.models.weights.hf_weight_buckets` consumed bucket by
  bucket and let go, as an engine that copies each bucket into its own weights would.

How to read the table: seconds are the median over the repeats; peak MiB is the largest rise of
a process's resident memory over its level before the refit (sampled every 0.5 ms by a thread;
the largest over the ranks), so it is the refit's own extra memory. The model itself (fp32) is
in the "model MiB" column.

Run: ``python benchmarks/refit.py [--repeats 3 --bucket-mb 16]`` (it starts the two-process
layout itself with torchrun).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_orch import config as config_lib
from nemo_orch import distributed
from nemo_orch.config import Config
from nemo_orch.distributed import free_port
from nemo_orch.models import qwen3, weights
from nemo_orch.models.hf_mapping import SeededHFWeights, megatron_to_hf

SIZES = {
    "tiny": ["model=tiny"],
    "micro": ["model=micro"],
    "124M": [
        "model=micro",
        "model.num_layers=12",
        "model.hidden_size=768",
        "model.num_attention_heads=12",
        "model.num_query_groups=4",
        "model.kv_channels=64",
        "model.ffn_hidden_size=2048",
        "model.vocab_size=32000",
        "tokenizer.vocab_size=32000",
    ],
}
LAYOUTS = {"1 process": 1, "TP=2": 2}
PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def peak_rise(work: Callable[..., object], *args: object) -> tuple[float, int]:
    """Seconds ``work(*args)`` takes and the largest rise of resident memory meanwhile."""
    gc.collect()
    before, peak, done = _resident(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _resident())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    result = work(*args)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    del result
    return seconds, max(peak[0], _resident()) - before


def pickled_gather(module: torch.nn.Module, config: Config, bucket_mb: int) -> dict | None:
    """The refit before its buckets (see the module docstring): every rank's whole state,
    pickled, onto every rank; rank 0 keeps data-parallel replica 0's and maps it to HF. The
    parity test (``tests/multiprocess/grpo_step.py``) checks the buckets against it."""
    from megatron.core import parallel_state as ps

    layout = weights.rank_layout()
    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        shards,
        (
            ps.get_data_parallel_rank(),
            layout.pp_rank,
            layout.tp_rank,
            {name: tensor.cpu() for name, tensor in weights.parameter_state(module).items()},
        ),
    )
    if dist.get_rank() != 0:
        return None
    stages = [[None] * layout.tp_size for _ in range(layout.pp_size)]
    for dp_rank, pp_rank, tp_rank, state in shards:
        if dp_rank == 0:
            stages[pp_rank][tp_rank] = state
    return megatron_to_hf(stages, config.model)


def bucketed_gather(module: torch.nn.Module, config: Config, bucket_mb: int) -> dict | None:
    return weights.gather_hf_weights(module, config.model, bucket_mb)


def stream(module: torch.nn.Module, config: Config, bucket_mb: int) -> int:
    count = 0
    for bucket in weights.hf_weight_buckets(module, config.model, bucket_mb << 20):
        count += len(bucket)
        del bucket
    return count


METHODS = {
    "pickled gather": pickled_gather,
    "bucketed gather": bucketed_gather,
    "bucketed stream": stream,
}


def worker(repeats: int, bucket_mb: int) -> None:
    """One layout's rows (this process is one of its ranks); rank 0 prints them as JSON."""
    torch.set_num_threads(1)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    rows = []
    configs = {
        size: config_lib.load([*overrides, f"parallel.tp={tp}"])
        for size, overrides in SIZES.items()
    }
    first = next(iter(configs.values()))
    with distributed.parallel_session(first.parallel, first.run.seed):
        for size, config in configs.items():
            module = qwen3.build_model(
                config.model, config.parallel, pre_process=True, post_process=True
            )
            weights.load_hf_weights(module, SeededHFWeights(config.model, 0), config.model)
            model_bytes = tp * sum(
                tensor.numel() * tensor.element_size()
                for tensor in weights.parameter_state(module).values()
            )
            for method, refit in METHODS.items():
                runs = []
                for _ in range(repeats):
                    dist.barrier()
                    runs.append(peak_rise(refit, module, config, bucket_mb))
                peak = torch.tensor([max(rise for _, rise in runs)])
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                rows.append(
                    {
                        "size": size,
                        "model_mib": model_bytes / 2**20,
                        "method": method,
                        "seconds": statistics.median(seconds for seconds, _ in runs),
                        "peak_mib": int(peak) / 2**20,
                    }
                )
        if dist.get_rank() == 0:
            print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats, args.bucket_mb)
        return
    table = []
    for layout, processes in LAYOUTS.items():
        launched = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={processes}",
                "--nnodes=1",
                "--master_addr=127.0.0.1",
                f"--master_port={free_port()}",
                str(Path(__file__).resolve()),
                "--worker",
                f"--repeats={args.repeats}",
                f"--bucket-mb={args.bucket_mb}",
            ],
            capture_output=True,
            text=True,
            check=False,
            # every large tensor its own mapping, returned when freed: a method's peak does not
            # hide in memory an earlier one left to the allocator
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 16)},
        )
        if launched.returncode != 0:
            sys.exit(launched.stderr[-3000:])
        table += [
            {"layout": layout, **row}
            for row in json.loads(launched.stdout.strip().splitlines()[-1])
        ]
    print(
        f"refit, buckets of {args.bucket_mb} MiB, fp32, 1 thread per process, "
        f"median of {args.repeats}\n"
    )
    print("| model | model MiB | layout | method | seconds | peak MiB |")
    print("|---|---:|---|---|---:|---:|")
    for row in table:
        print(
            f"| {row['size']} | {row['model_mib']:.0f} | {row['layout']} | {row['method']} | "
            f"{row['seconds']:.3f} | {row['peak_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
