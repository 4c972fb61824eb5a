"""Sandbox call overhead: the warm ``python_sandbox`` pool vs. a fresh ``python -c`` per call.

What it measures: wall-clock seconds for ``print(1)``, ``--calls`` times each, sequentially:

* **warm pool**: ``PythonSandbox.call`` with a pool of ``--pool-size`` workers forked ahead
  from the pool's zygote, and whatever isolation this host allows (listed under the table).
  Each call takes a waiting worker; its replacement is forked in the background (namespaces,
  private root, cgroups) while the next call is timed, as in real use.
* **fresh subprocess**: ``asyncio.create_subprocess_exec(python, "-c", code)`` per call with a
  timeout and captured output, no isolation: what a minimal reference implementation does.

How to read the table: p50/p99 are over the timed calls (after ``--warmup`` untimed ones); the
last column is fresh / warm, so above 1 means the warm pool is faster. The warm pool hides the
interpreter start-up and the isolation's set-up but pays for the handoff over pipes and the
kill of the call's process tree; on a 2-core machine the background refill competes with the
timed call for CPU, so the back-to-back p99 includes that.

Run: ``python benchmarks/sandbox.py [--calls 50 --warmup 3 --pool-size 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.sandbox import PythonSandbox, default_spec
from nemo_orch.tools.sandbox.pool import DEFAULT_POOL_SIZE

CODE = "print(1)"


async def _time_calls(
    call: Callable[[], Awaitable[str]],
    calls: int,
    warmup: int,
    settle: Callable[[], Awaitable[None]] | None = None,
) -> list[float]:
    seconds = []
    for i in range(warmup + calls):
        if settle is not None:
            await settle()
        started = time.perf_counter()
        output = await call()
        elapsed = time.perf_counter() - started
        if output != "1\n":
            raise RuntimeError(f"unexpected output {output!r}")
        if i >= warmup:
            seconds.append(elapsed)
    return seconds


async def _fresh_subprocess() -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CODE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await asyncio.wait_for(proc.communicate(), 10.0)
    return output.decode()


def _percentile(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


async def main(args: argparse.Namespace) -> None:
    sandbox = PythonSandbox(default_spec(), pool_size=args.pool_size)
    await sandbox.start()
    try:

        async def warm() -> str:
            result = await sandbox.call({"code": CODE}, ToolContext())
            if result.error:
                raise RuntimeError(result.error)
            return result.output

        # Untimed: let the pool refill and retired workers go, as during a model turn.
        async def settle() -> None:
            while len(sandbox._idle) < sandbox.pool_size or sandbox._tasks:
                await asyncio.sleep(0.005)

        rows = {
            "warm pool (back-to-back)": await _time_calls(warm, args.calls, args.warmup),
            "warm pool (refilled between calls)": await _time_calls(
                warm, args.calls, args.warmup, settle
            ),
            "fresh `python -c` per call": await _time_calls(
                _fresh_subprocess, args.calls, args.warmup
            ),
        }
    finally:
        await sandbox.close()

    fresh_p50 = statistics.median(rows["fresh `python -c` per call"])
    print(
        f"{args.calls} sequential `print(1)` calls each; {platform.processor() or 'cpu'}, "
        f"Python {platform.python_version()}, isolation: {', '.join(sandbox.isolation)}\n"
    )
    print("| path | p50 ms | p99 ms | fresh p50 / p50 |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows.items():
        p50 = statistics.median(seconds)
        print(
            f"| {name} | {p50 * 1e3:.1f} | {_percentile(seconds, 99) * 1e3:.1f} | "
            f"{fresh_p50 / p50:.2f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pool-size", type=int, default=DEFAULT_POOL_SIZE)
    asyncio.run(main(parser.parse_args()))
