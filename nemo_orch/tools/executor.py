"""A toolbox served by a Ray actor, and the tools that call it from another process.

The tool executors of ``rollout.backend=ray`` (:mod:`nemo_orch.rollout.ray_workers`): tools run
out of the engine's process (a crashing or memory-hungry tool does not take the engine down, and
Ray may place them on nodes of their own). This module imports only Ray and the tool seam, so an
executor whose toolbox is light starts in the time Ray takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from nemo_orch.call_kinds import CallKind
from nemo_orch.tools.base import BaseTool, ToolContext, ToolResult, ToolSpec
from nemo_orch.tools.registry import Toolbox

# The executor times a call out; a proxy's own toolbox waits this much longer before it does.
EXECUTOR_GRACE_S = 5.0


@ray.remote(num_cpus=0)
class ToolExecutor:
    """A toolbox in an actor: it validates, bounds, times out and caches the calls sent to it and
    keeps their per-episode state (a domain's databases)."""

    def __init__(self, make_toolbox: Callable[[], Toolbox]) -> None:
        self.toolbox = make_toolbox()

    async def start(self) -> tuple[list[ToolSpec], dict[str, str]]:
        await self.toolbox.start()
        return await self.offered()

    async def offered(self) -> tuple[list[ToolSpec], dict[str, str]]:
        """The tools on offer now (the sources that changed listed again) and the source of
        those that came from one."""
        await self.toolbox.refresh()
        return list(self.toolbox.specs.values()), dict(self.toolbox.source_of)

    async def call(self, name: str, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        return await self.toolbox.call(name, arguments, context)

    async def close(self) -> None:
        await self.toolbox.close()


class ExecutorTool(BaseTool):
    """A tool whose calls run in a :class:`ToolExecutor`. The executor caches and times out;
    here nothing is cached and the timeout is a backstop. A call that finds the executor dead
    is an error result and is written to ``lost``, so its caller can tell its observations are
    not the tools' and run the episodes again."""

    def __init__(self, spec: ToolSpec, executor: ActorHandle, lost: list[str]) -> None:
        super().__init__(
            dataclasses.replace(
                spec, deterministic=False, timeout_s=spec.timeout_s + EXECUTOR_GRACE_S
            )
        )
        self.executor, self.lost = executor, lost

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        try:
            return await self.executor.call.remote(self.spec.name, arguments, context)
        except RayActorError as error:
            self.lost.append(f"{type(error).__name__}: {error}")
            return ToolResult(
                error=f"{self.spec.name}: the tool executor died", kind=CallKind.INFRA_ERROR
            )


def executor_toolbox(
    executor: ActorHandle, offered: tuple[list[ToolSpec], dict[str, str]], lost: list[str]
) -> Toolbox:
    """A toolbox of :class:`ExecutorTool` for what ``executor.offered`` returned."""
    specs, source_of = offered
    toolbox = Toolbox([ExecutorTool(spec, executor, lost) for spec in specs], cache_entries=0)
    toolbox.source_of = dict(source_of)
    return toolbox
