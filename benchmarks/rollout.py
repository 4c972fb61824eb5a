"""Rollout throughput: concurrent episodes on one asyncio loop vs. a strictly sequential runner.

What it measures: episodes per second for the same workload run four ways, in one process:

* **sequential**: one episode after another, each turn's generation a separate engine call,
  each tool call awaited before anything else happens (a plain loop, no batching).
* **concurrent N** (N = 1, 8, 32): :func:`nemo_orch.rollout.runner.run_rollouts` with
  ``rollout.max_concurrent_episodes = N``: episodes waiting on the policy share one engine call
  (:class:`GenerationBatcher`), and tool calls of different episodes overlap.

The workload: every episode calls a tool ``--calls-per-episode`` times, then answers. The tool
sleeps ``--tool-latency-s`` (default 0.2 s: a retrieval service or an expert model's latency).
The policy is the :class:`ScriptedEngine` (not a model: it writes the tool calls on purpose) with
``--generation-s`` per engine call whatever the batch size, a stand-in for a batched forward pass
on an accelerator, where a batch of 32 costs about what a batch of 1 does. The numbers therefore
measure the rollout machinery and its overlap, not a model's speed.

How to read the table: "episodes/s" is episodes / wall seconds; "speed-up" is relative to the
sequential runner in the same run; "mean batch" is prompts per engine call. Concurrency 1 should
match the sequential runner (no overlap is possible); speed-ups beyond that come from batching
generation and overlapping tool waits, bounded by the tool's ``max_concurrency`` (set to 64).

Run: ``python benchmarks/rollout.py [--episodes 64 --sequential-episodes 16 --tool-latency-s 0.2
--generation-s 0.02 --calls-per-episode 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import tempfile
import time
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.config import RolloutConfig
from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline.generator import generate_conversations
from nemo_orch.models.tokenizer import render_conversation, train_tokenizer
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.rollout.episode import Episode
from nemo_orch.rollout.runner import DirectPolicy, run_rollouts
from nemo_orch.tools.base import BaseTool, ToolContext, ToolResult, ToolSpec
from nemo_orch.tools.registry import Toolbox

LOOKUP_PARAMETERS = {
    "type": "object",
    "properties": {"key": {"type": "string"}},
    "required": ["key"],
}


class FixedLatencyLookup(BaseTool):
    """Answers after a fixed delay: a stand-in for a remote service of known latency."""

    def __init__(self, latency_s: float) -> None:
        super().__init__(
            ToolSpec(
                "lookup",
                "Look a key up (slow service).",
                LOOKUP_PARAMETERS,
                latency_hint_s=latency_s,
                max_concurrency=64,
            )
        )
        self.latency_s = latency_s

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        await asyncio.sleep(self.latency_s)
        return ToolResult(output=f"value of {arguments['key']}")


def scripted_policy(calls_per_episode: int):
    def reply(prompt: str) -> str:
        done = len(re.findall(r"<tool_response>", prompt))
        if done < calls_per_episode:
            call = {"name": "lookup", "arguments": {"key": f"k{done}"}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return "<answer>done</answer>"

    return reply


async def sequential(
    tasks: list[Task],
    engine: ScriptedEngine,
    toolbox: Toolbox,
    tokenizer: PreTrainedTokenizerBase,
    settings: RolloutConfig,
) -> list:
    """One episode at a time; each generation its own engine call."""
    policy = DirectPolicy(engine)
    return [await Episode(task, 0, policy, toolbox, tokenizer, settings).run() for task in tasks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--sequential-episodes", type=int, default=16)
    parser.add_argument("--tool-latency-s", type=float, default=0.2)
    parser.add_argument("--generation-s", type=float, default=0.02)
    parser.add_argument("--calls-per-episode", type=int, default=3)
    args = parser.parse_args()

    texts = (
        render_conversation(c["messages"], c["tools"]) for c in generate_conversations(200, seed=0)
    )
    with tempfile.TemporaryDirectory() as directory:
        tokenizer = train_tokenizer(texts, vocab_size=1000, min_frequency=2, out_dir=directory)
    engine = ScriptedEngine(
        tokenizer, scripted_policy(args.calls_per_episode), seconds_per_call=args.generation_s
    )
    toolbox = Toolbox([FixedLatencyLookup(args.tool_latency_s)])

    def tasks(n: int) -> list[Task]:
        return [Task(f"t{i}", f"Look up item {i}.") for i in range(n)]

    rows = []

    def record(name: str, episodes: int, seconds: float, batches: list[int]) -> None:
        rows.append((name, episodes, seconds, episodes / seconds, sum(batches) / len(batches)))

    engine.batch_sizes.clear()
    start = time.perf_counter()
    done = asyncio.run(
        sequential(
            tasks(args.sequential_episodes),
            engine,
            toolbox,
            tokenizer,
            RolloutConfig(max_context_tokens=2048),
        )
    )
    record("sequential", len(done), time.perf_counter() - start, engine.batch_sizes)
    assert all(t.termination == "answer" for t in done)

    for concurrency in (1, 8, 32):
        settings = RolloutConfig(max_context_tokens=2048, max_concurrent_episodes=concurrency)
        n = args.sequential_episodes if concurrency == 1 else args.episodes
        engine.batch_sizes.clear()
        start = time.perf_counter()
        done = asyncio.run(run_rollouts(tasks(n), 1, engine, toolbox, tokenizer, settings))
        record(
            f"concurrent {concurrency}", len(done), time.perf_counter() - start, engine.batch_sizes
        )
        assert all(t.termination == "answer" for t in done)

    base = rows[0][3]
    print(
        f"# rollout throughput ({platform.processor() or platform.machine()}, tool latency "
        f"{args.tool_latency_s:g} s x {args.calls_per_episode} calls, generation "
        f"{args.generation_s:g} s per engine call)\n"
    )
    print("| runner | episodes | seconds | episodes/s | speed-up | mean batch |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, episodes, seconds, rate, batch in rows:
        print(
            f"| {name} | {episodes} | {seconds:.2f} | {rate:.2f} | {rate / base:.1f}x | "
            f"{batch:.1f} |"
        )


if __name__ == "__main__":
    main()
