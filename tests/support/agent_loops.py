"""Agent loops that misbehave, for the training endpoint's tests
(``rollout.external.harness=support.agent_loops:<name>``)."""

from __future__ import annotations

import json

from openai import OpenAI

from nemo_orch.rollout.agent_episode import AgentEpisode


def rewriting_loop(episode: AgentEpisode) -> None:
    """Keeps its own summary of the policy's first turn instead of the reply, and asks again
    streaming: the record must branch."""
    client = OpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
    messages = list(episode.messages)
    reply = (
        client.chat.completions.create(model=episode.model, messages=messages, tools=episode.tools)
        .choices[0]
        .message
    )
    (call,) = reply.tool_calls
    result = episode.call_tool(call.function.name, json.loads(call.function.arguments))
    messages += [
        {"role": "assistant", "content": f"I ran {call.function.name}."},
        {"role": "tool", "tool_call_id": call.id, "content": result["output"]},
    ]
    stream = client.chat.completions.create(
        model=episode.model, messages=messages, tools=episode.tools, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    episode.end(correct=text.startswith("<answer>"))


def raising_loop(episode: AgentEpisode) -> None:
    raise ConnectionError("the agent's own backend is down")
