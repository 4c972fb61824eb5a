"""An orchestrator built with the OpenAI Agents SDK, trained as it runs.

``rollout.agent=external
rollout.external.harness=examples/agent_loops/openai_agents_loop.py:run_episode``
(docs/agent_loops.md): the SDK's own ``Runner`` drives the episode through its Chat Completions
model pointed at the episode's base URL; the world's tools are ``FunctionTool``\\ s that call
``episode.call_tool``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    Runner,
    set_tracing_disabled,
)
from openai import APIStatusError, AsyncOpenAI

from nemo_orch.rollout.agent_episode import AgentEpisode

set_tracing_disabled(True)  # nothing leaves the machine


def world_tool(episode: AgentEpisode, schema: dict[str, Any]) -> FunctionTool:
    function = schema["function"]

    async def invoke(_context: Any, arguments: str) -> str:
        result = await asyncio.to_thread(
            episode.call_tool, function["name"], json.loads(arguments or "{}")
        )
        return result["output"]

    return FunctionTool(
        name=function["name"],
        description=function.get("description", ""),
        params_json_schema=function["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )


def run_episode(episode: AgentEpisode) -> None:
    system, question = episode.messages[0]["content"], episode.messages[-1]["content"]
    agent = Agent(
        name="orchestrator",
        instructions=system,
        model=OpenAIChatCompletionsModel(
            model=episode.model,
            openai_client=AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0),
        ),
        tools=[world_tool(episode, schema) for schema in episode.tools],
    )
    try:
        Runner.run_sync(agent, question, max_turns=10)
    except MaxTurnsExceeded:
        pass
    except APIStatusError as error:
        if error.status_code != 409:  # 409: the episode has ended (an answer, a limit)
            raise
    episode.end()
