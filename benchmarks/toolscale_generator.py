"""The offline ToolScale generator: tasks per second and the time for 10k tasks.

What it measures, per domain and for all three together: drawing ``--tasks`` tasks (each goal's
gold actions executed on a working copy of the database as it is drawn), running every task
through the validation filters (two more replays on fresh databases) and streaming them to a
JSONL file. The domain's database is built once, outside the timing. Each run is repeated with the
same seed, and the files must be byte-identical (the ``deterministic`` column).

How to read it: ``tasks/s`` is end to end, so the ``10k tasks`` column is what generating the
offline set costs on this machine; ``actions`` is the mean number of gold actions per task, and
the histogram shows the spread of difficulty (1 to 8+ gold actions).

Run: ``python benchmarks/toolscale_generator.py [--tasks 10000 --seed 0]``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path

from nemo_orch.data.domain_tasks import write_domain_tasks
from nemo_orch.envs.toolscale.domain_records import generate_domain
from nemo_orch.envs.toolscale.domain_specs import DOMAINS
from nemo_orch.envs.toolscale.generator import generate_tasks
from nemo_orch.envs.toolscale.validate import ValidationSummary


def _generate(name: str, tasks: int, seed: int, path: Path) -> tuple[float, str, Counter]:
    domain = generate_domain(name, seed)
    sizes: Counter = Counter()

    def counted():
        for task in itertools.islice(generate_tasks(domain, seed, ValidationSummary()), tasks):
            sizes[len(task.gold_actions)] += 1
            yield task

    started = time.perf_counter()
    write_domain_tasks(path, counted())
    seconds = time.perf_counter() - started
    return seconds, hashlib.sha256(path.read_bytes()).hexdigest(), sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks per domain")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}"
        f"; {args.tasks} tasks per domain, seed {args.seed}"
    )
    print("| domain | tasks/s | 10k tasks (s) | actions | deterministic | gold actions: tasks |")
    print("|---|---:|---:|---:|---|---|")
    total_seconds, total_sizes = 0.0, Counter()
    with tempfile.TemporaryDirectory() as scratch:
        for name in DOMAINS:
            seconds, digest, sizes = _generate(
                name, args.tasks, args.seed, Path(scratch) / f"{name}.jsonl"
            )
            _, again, _ = _generate(name, args.tasks, args.seed, Path(scratch) / "again.jsonl")
            total_seconds += seconds
            total_sizes.update(sizes)
            mean = sum(k * v for k, v in sizes.items()) / args.tasks
            histogram = " ".join(f"{k}:{v}" for k, v in sorted(sizes.items()))
            print(
                f"| {name} | {args.tasks / seconds:.0f} | {1e4 * seconds / args.tasks:.1f} | "
                f"{mean:.2f} | {digest == again} | {histogram} |"
            )
    count = args.tasks * len(DOMAINS)
    mean = sum(k * v for k, v in total_sizes.items()) / count
    print(
        f"| all | {count / total_seconds:.0f} | {1e4 * total_seconds / count:.1f} | "
        f"{mean:.2f} | | {sum(v for k, v in total_sizes.items() if k >= 8)} with 8+ |"
    )


if __name__ == "__main__":
    main()
