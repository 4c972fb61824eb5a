"""An orchestrator loop written with the plain ``openai`` SDK, trained as it runs.

nemo-orch calls ``run_episode`` once per episode (``rollout.agent=external
rollout.external.harness=examples/agent_loops/openai_loop.py:run_episode``; see
docs/agent_loops.md). The loop is what it would be in production but for two lines: the client's
``base_url`` is the episode's, and the world's tools are called through ``episode.call_tool``,
so the environment runs and bills them. Swap in your own functions and it runs them itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from openai import ConflictError, OpenAI

from nemo_orch.rollout.agent_episode import AgentEpisode

MAX_TURNS = 10


def world_tools(episode: AgentEpisode) -> dict[str, Callable[..., dict[str, Any]]]:
    """Each offered tool as a function of its arguments."""

    def tool(name: str) -> Callable[..., dict[str, Any]]:
        return lambda **arguments: episode.call_tool(name, arguments)

    return {
        schema["function"]["name"]: tool(schema["function"]["name"]) for schema in episode.tools
    }


def run_episode(episode: AgentEpisode) -> None:
    client = OpenAI(base_url=episode.base_url, api_key="not-needed", max_retries=0)
    tools, messages = world_tools(episode), list(episode.messages)
    for _ in range(MAX_TURNS):
        try:
            reply = (
                client.chat.completions.create(
                    model=episode.model, messages=messages, tools=episode.tools
                )
                .choices[0]
                .message
            )
        except ConflictError:  # the episode has ended: a limit of the trainer's
            break
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:  # a final message
            break
        answered = False
        for call in reply.tool_calls:
            tool = tools.get(call.function.name)
            if tool is None:
                result = {"output": f"Error: no tool {call.function.name}", "answer": None}
            else:
                result = tool(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result["output"]})
            answered = answered or result["answer"] is not None
        if answered:
            break
    episode.end()
