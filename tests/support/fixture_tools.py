"""Small real tools for testing the toolbox and the rollout loop: they sleep, echo, count and
fail on request, so timing and error paths can be checked exactly."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from nemo_orch.tools.base import BaseTool, ToolContext, ToolResult, ToolSpec, Usage
from nemo_orch.tools.registry import Toolbox

ECHO_PARAMETERS = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "delay_s": {"type": "number", "minimum": 0}},
    "required": ["text"],
}


class DelayedEcho(BaseTool):
    """Echoes ``text`` after ``delay_s`` (argument) or ``default_delay_s`` (option); ``text ==
    "raise"`` raises, to exercise the toolbox's exception path."""

    def __init__(self, spec: ToolSpec, default_delay_s: float = 0.0, prefix: str = "") -> None:
        super().__init__(spec)
        self.default_delay_s, self.prefix = default_delay_s, prefix
        self.calls = 0
        self.running = 0
        self.max_running = 0
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        self.calls += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(arguments.get("delay_s", self.default_delay_s))
            if arguments["text"] == "raise":
                raise RuntimeError("asked to fail")
            usage = Usage(input_tokens=len(arguments["text"]), output_tokens=1)
            return ToolResult(
                output=self.prefix + arguments["text"],
                usage=usage,
                cost_usd=self.spec.pricing.cost(usage, 0.0),
            )
        finally:
            self.running -= 1


def echo_spec(name: str = "echo", **fields: Any) -> ToolSpec:
    return ToolSpec(
        name=name, description="Echo the text back.", parameters=ECHO_PARAMETERS, **fields
    )


class ContextRecorder(DelayedEcho):
    """An echo that keeps the observations each call was handed and, for ``text == "final"``,
    answers (ending the episode)."""

    def __init__(self, spec: ToolSpec, **options: Any) -> None:
        super().__init__(spec, **options)
        self.handed: list[tuple[str, ...]] = []

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        self.handed.append(context.observations)
        result = await super().call(arguments, context)
        if arguments["text"] == "final":
            return dataclasses.replace(result, answer="done")
        return result


class SeedEcho(BaseTool):
    """Echoes ``text`` and the calling episode's seed: which seed an episode got, wherever it
    ran."""

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        return ToolResult(output=f"{arguments['text']} seed {context.seed}")


class MarkedEcho(DelayedEcho):
    """A delayed echo that creates ``marks/<episode id>`` when a call starts: a test sees from
    another process that an episode is inside a tool call."""

    def __init__(self, spec: ToolSpec, marks: str, **options: Any) -> None:
        super().__init__(spec, **options)
        self.marks = Path(marks)

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        (self.marks / context.episode_id).touch()
        return await super().call(arguments, context)


def seed_and_slow_toolbox(marks: str) -> Toolbox:
    """``seed`` (:class:`SeedEcho`), ``echo`` and ``slow`` (1 s, marked in ``marks``): light to
    import, so a Ray tool executor builds it without the project's heavy modules."""
    return Toolbox(
        [
            SeedEcho(echo_spec("seed")),
            DelayedEcho(echo_spec("echo")),
            MarkedEcho(echo_spec("slow"), marks, default_delay_s=1.0),
        ]
    )


class Faulty(BaseTool):
    """A tool that fails as asked by its ``mode`` argument (an enum, so GRPO's directed
    exploration forces every mode in turn): ``raise`` raises, ``hang`` sleeps past any
    timeout, ``huge`` returns ``huge_bytes`` of output, ``ok`` answers."""

    def __init__(self, spec: ToolSpec, huge_bytes: int = 10 << 20) -> None:
        super().__init__(spec)
        self.huge_bytes = huge_bytes

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        mode = arguments["mode"]
        if mode == "raise":
            raise RuntimeError("injected fault")
        if mode == "hang":
            await asyncio.sleep(3600)
        return ToolResult(output="x" * self.huge_bytes if mode == "huge" else "fine")


class ExpertOnTheQuestion(BaseTool):
    """An expert (an OpenAI-compatible endpoint, through :class:`~nemo_orch.tools.llm.LLMTool`)
    asked the task's own question: its only argument is the ``model`` enum, so directed
    exploration calls it without the policy writing a question."""

    def __init__(self, spec: ToolSpec, **options: Any) -> None:
        from nemo_orch.tools.llm import LLMTool

        super().__init__(spec)
        self.expert = LLMTool(spec, **options)

    async def close(self) -> None:
        await self.expert.close()

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        return await self.expert.ask(arguments["model"], context.task.question)
