"""The monolith baseline's agent against real local endpoints: the SIMULATED chat model with the
offline tools, the project's own OpenAI-compatible server replying with ``<tool_call>`` markup,
a scripted server replying with standard ``tool_calls``, and servers that fail."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import httpx
import pytest
from support.fixture_tools import ContextRecorder, echo_spec

from nemo_orch.clients.openai import OpenAIClient
from nemo_orch.config import CONF_DIR
from nemo_orch.data.tasks import Task
from nemo_orch.envs.offline.world import make_tasks
from nemo_orch.eval.chat_agent import ChatAgent
from nemo_orch.eval.simulated_chat import TOOL_CALL_TOKENS, start_simulated_chat_server
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.http_server import serve_json
from nemo_orch.serve.openai_server import start_server
from nemo_orch.tools.base import Pricing, Usage
from nemo_orch.tools.pricing import model_pricing
from nemo_orch.tools.registry import Toolbox, load_toolbox
from nemo_orch.tools.simulated_expert import SimulatedModel

OFFLINE_TOOLS = CONF_DIR / "tools" / "offline"
SIMULATED = "simulated-gpt-5"
# Always right when it can be (the evidence found, or known math), never on the made-up world
# without the evidence: which route it took shows in the answer.
MODEL = SimulatedModel(
    "gpt-5",
    {"easy": 1.0, "hard": 1.0, "language": 1.0, "unknown": 0.0},
    mean_output_tokens=200,
    tokens_per_second=100,
)
TIME_SCALE = 0.01
PRICE = model_pricing("gpt-5")
TASKS = make_tasks(12, seed=3)


def call_markup(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def echo_toolbox() -> Toolbox:
    return Toolbox([ContextRecorder(echo_spec(pricing=Pricing(per_call=0.01)))])


@pytest.fixture(scope="module")
def simulated_server():
    with start_simulated_chat_server(TASKS, MODEL, SIMULATED, time_scale=TIME_SCALE) as handle:
        yield handle


def run_simulated(url: str, tasks: list[Task], seeds: list[int]):
    """Per seed, one episode of each task, all concurrently, with the offline basic tools."""

    async def episodes():
        toolbox = load_toolbox([OFFLINE_TOOLS]).subset(["search", "python_sandbox"])
        async with toolbox:
            agent = ChatAgent(
                OpenAIClient(url, SIMULATED, timeout_s=10), toolbox, PRICE, max_turns=4
            )
            return await asyncio.gather(
                *(
                    asyncio.gather(*(agent.episode(task, 0, seed) for task in tasks))
                    for seed in seeds
                )
            )

    return asyncio.run(episodes())


def test_simulated_monolith_searches_then_answers(simulated_server):
    lookups = [t for t in TASKS if t.metadata["evidence_route"]]
    others = [t for t in TASKS if not t.metadata["evidence_route"]]
    assert lookups and others
    trajectories, again, other_seed = run_simulated(simulated_server.url, TASKS, [7, 7, 8])
    for task, trajectory in zip(TASKS, trajectories):
        assert trajectory.termination == "answer" and trajectory.format_errors == {}
        assert trajectory.answer == task.answer  # its accuracy is 1 where it can know
        assert trajectory.messages[-1]["content"] == f"<answer>{task.answer}</answer>"
        assert trajectory.token_ids == [] and trajectory.prompt_length == 0
        for turn in trajectory.turns:  # billed at the monolith's price, timed by its request
            assert turn.input_tokens > 0
            assert turn.orchestrator_cost_usd == pytest.approx(
                PRICE.cost(Usage(turn.input_tokens, turn.output_tokens), 0.0)
            )
            assert turn.generation_seconds >= (
                TIME_SCALE * turn.output_tokens / MODEL.tokens_per_second
            )
        assert trajectory.cost_usd == pytest.approx(
            sum(turn.orchestrator_cost_usd for turn in trajectory.turns)
        )
        if task in lookups:
            call = trajectory.messages[2]["tool_calls"][0]
            assert call["function"] == {"name": "search", "arguments": "{}"}
            assert trajectory.tool_counts() == {"search": 1} and len(trajectory.turns) == 2
            assert trajectory.turns[0].output_tokens == TOOL_CALL_TOKENS
            assert trajectory.turns[0].finish_reason == "tool_calls"
            tool_message = trajectory.messages[3]
            assert tool_message["role"] == "tool" and tool_message["tool_call_id"] == call["id"]
            assert task.metadata["evidence"] in tool_message["content"]
        else:
            assert trajectory.tool_counts() == {} and len(trajectory.turns) == 1

    assert [(t.answer, t.cost_usd) for t in again] == [(t.answer, t.cost_usd) for t in trajectories]
    assert [t.cost_usd for t in other_seed] != [t.cost_usd for t in trajectories]


def test_simulated_monolith_without_search_misses_made_up_facts(simulated_server):
    lookup = next(t for t in TASKS if t.metadata["evidence_route"])
    ((trajectory,),) = run_simulated(
        simulated_server.url, [dataclasses.replace(lookup, tools=("python_sandbox",))], [0]
    )
    assert [tool["function"]["name"] for tool in trajectory.tools] == ["python_sandbox"]
    assert trajectory.tool_counts() == {} and trajectory.termination == "answer"
    assert trajectory.answer != lookup.answer  # "unknown" without the evidence: accuracy 0


def test_simulated_server_rejects_bad_requests_and_stays_up(simulated_server):
    url = f"{simulated_server.url}/chat/completions"
    question = TASKS[0].question
    bad = {
        "not JSON": (b"{messages: [", 400, "not valid JSON"),
        "no messages": ({"model": SIMULATED}, 400, "'messages' must be a non-empty list"),
        "bad message": ({"messages": ["hi"]}, 400, "messages[0] must be an object"),
        "bad tools": (
            {"messages": [{"role": "user", "content": question}], "tools": {}},
            400,
            "'tools' must be a list",
        ),
        "bad seed": (
            {"messages": [{"role": "user", "content": question}], "seed": "1"},
            400,
            "'seed' must be an integer",
        ),
        "unknown question": (
            {"messages": [{"role": "user", "content": "What is love?"}]},
            400,
            "only answers the benchmark's tasks",
        ),
        "wrong model": (
            {"model": "gpt-5", "messages": [{"role": "user", "content": question}]},
            404,
            "does not exist",
        ),
    }
    with httpx.Client(timeout=10) as client:
        for name, (body, status, message) in bad.items():
            response = (
                client.post(url, content=body)
                if isinstance(body, bytes)
                else client.post(url, json=body)
            )
            assert response.status_code == status, name
            assert message in response.json()["error"]["message"], name
        ok = client.post(
            url,
            json={
                "model": SIMULATED,
                "seed": 1,
                "messages": [{"role": "user", "content": question}],
            },
        )
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"].startswith("<answer>")
        models = client.get(f"{simulated_server.url}/models").json()
        assert [entry["id"] for entry in models["data"]] == [SIMULATED]


def markup_reply(prompt: str) -> str:
    """First a malformed call and a call of an unknown tool, then a valid echo, then the answer
    read from the echo's response."""
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.DOTALL)
    if not responses:
        return (
            '<tool_call>\n{"name": "echo", "arguments": {"text": }\n</tool_call>\n'
            + call_markup("browse", {"url": "x"})
        )
    if "hello" not in responses:
        return "<think>retry</think>" + call_markup("echo", {"text": "hello"})
    return f"<think>got it</think><answer>{responses[-1].upper()}</answer>"


@pytest.fixture(scope="module")
def markup_server(tiny_tokenizer):
    with start_server(
        ScriptedEngine(tiny_tokenizer, markup_reply), tiny_tokenizer, "scripted"
    ) as handle:
        yield handle


def test_markup_calls_errors_and_recovery(markup_server):
    toolbox = echo_toolbox()
    agent = ChatAgent(
        OpenAIClient(markup_server.url, "scripted"),
        toolbox,
        Pricing.per_million_tokens(1.0, 2.0),
        max_turns=5,
    )
    trajectory = asyncio.run(agent.episode(Task("t", "Say hello.", system="Use tools."), 0, 3))
    assert trajectory.termination == "answer" and trajectory.answer == "HELLO"
    assert trajectory.format_errors == {"malformed_json": 1, "unknown_tool": 1}
    assert [turn.format_errors for turn in trajectory.turns] == [
        ["malformed_json", "unknown_tool"],
        [],
        [],
    ]
    first = trajectory.turns[0].calls
    assert [(c.tool, c.error is not None) for c in first] == [(None, True), ("browse", True)]
    assert trajectory.calls() == [("browse", {"url": "x"}), ("echo", {"text": "hello"})]
    assert trajectory.tool_counts() == {"echo": 1}
    roles = [m["role"] for m in trajectory.messages]
    assert roles == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    tools = [m for m in trajectory.messages if m["role"] == "tool"]
    assert tools[0]["content"].startswith("Error: the tool call is not valid JSON")
    assert tools[1]["content"].startswith("Error: unknown tool 'browse'")
    assert [m["tool_call_id"] for m in tools] == ["call_0_0", "call_0_1", "call_1_0"]
    assert tools[2]["content"] == "hello"
    assert "tool_calls" not in trajectory.messages[2]  # markup is kept as written
    # The echo was handed the earlier observations; the cost is the tokens plus its fee.
    assert toolbox.tools["echo"].handed == [tuple(m["content"] for m in tools[:2])]
    assert trajectory.cost_usd == pytest.approx(
        0.01 + sum(t.input_tokens * 1e-6 + t.output_tokens * 2e-6 for t in trajectory.turns)
    )
    assert all(t.input_tokens > 0 and t.output_tokens > 0 for t in trajectory.turns)


def standard_route(body: dict) -> dict:
    """A scripted server with standard ``tool_calls``: bad JSON arguments and an unknown tool,
    then an echo that ends the episode (``final``), unless the question asks for a plain
    answer."""
    tool_messages = [m for m in body["messages"] if m["role"] == "tool"]
    question = body["messages"][-1]["content"] if not tool_messages else ""
    if question == "plain":
        message = {"role": "assistant", "content": "  Paris  "}
    elif question == "empty":
        message = {"role": "assistant", "content": ""}
    elif not tool_messages:
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "echo", "arguments": '{"text": '},
                },
                {"id": "b", "type": "function", "function": {"name": "fetch", "arguments": "{}"}},
                {"type": "function", "function": {"name": "echo", "arguments": '["x"]'}},
            ],
        }
    else:
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "echo", "arguments": '{"text": "final"}'},
                }
            ],
        }
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
    }


@pytest.fixture(scope="module")
def standard_server():
    with serve_json({("POST", "/v1/chat/completions"): standard_route}, url_path="/v1") as handle:
        yield handle


def test_standard_tool_calls_errors_and_ending_tool(standard_server):
    agent = ChatAgent(OpenAIClient(standard_server.url, "any"), echo_toolbox(), PRICE, max_turns=4)

    async def episodes():
        return await asyncio.gather(
            *(agent.episode(Task(name, name), 0, 0) for name in ("calls", "plain", "empty"))
        )

    calls, plain, empty = asyncio.run(episodes())
    assert calls.termination == "answer" and calls.answer == "done"  # the tool's answer
    assert calls.format_errors == {"malformed_json": 1, "bad_call_shape": 1, "unknown_tool": 1}
    assert [(c.tool, c.arguments) for c in calls.turns[0].calls] == [
        ("echo", None),
        ("fetch", {}),
        ("echo", None),
    ]
    echoed = calls.messages[1]["tool_calls"]
    assert [c["id"] for c in echoed] == ["a", "b", "call_0_2"]
    assert echoed[0]["function"]["arguments"] == '{"text": '
    tools = [m for m in calls.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["a", "b", "call_0_2", "c"]
    assert "not valid JSON" in tools[0]["content"] and "unknown tool 'fetch'" in tools[1]["content"]
    assert "must be a JSON object" in tools[2]["content"] and tools[3]["content"] == "final"
    assert calls.cost_usd == pytest.approx(0.01 + 2 * PRICE.cost(Usage(10, 5), 0.0))

    assert (plain.termination, plain.answer, plain.format_errors) == ("answer", "Paris", {})
    assert (empty.termination, empty.answer, empty.format_errors) == (
        "answer",
        None,
        {"no_call": 1},
    )


def test_max_turns(tiny_tokenizer):
    with start_server(
        ScriptedEngine(tiny_tokenizer, lambda _: call_markup("echo", {"text": "a"})),
        tiny_tokenizer,
        "loop",
    ) as handle:
        agent = ChatAgent(OpenAIClient(handle.url, "loop"), echo_toolbox(), PRICE, max_turns=3)
        trajectory = asyncio.run(agent.episode(Task("t", "Loop."), 0, 0))
    assert trajectory.termination == "max_turns" and trajectory.answer is None
    assert len(trajectory.turns) == 3 and trajectory.tool_counts() == {"echo": 3}


def failing_route(body: dict) -> dict:
    raise RuntimeError("the model crashed")


def test_endpoint_failures_end_the_episode(monkeypatch):
    monkeypatch.setenv("MONOLITH_KEY", "sk-secret-123")
    task = Task("t", "Anything?")
    with (
        serve_json({("POST", "/v1/chat/completions"): failing_route}, url_path="/v1") as failing,
        serve_json(
            {("POST", "/v1/chat/completions"): failing_route}, url_path="/v1", api_key="another-key"
        ) as locked,
    ):
        clients = {
            "500": OpenAIClient(failing.url, "m", max_retries=1, backoff_s=0.01),
            "401": OpenAIClient(locked.url, "m", api_key_env="MONOLITH_KEY", max_retries=0),
            "closed": OpenAIClient("http://127.0.0.1:9/v1", "m", max_retries=0, timeout_s=2),
        }
        trajectories = {
            name: asyncio.run(
                ChatAgent(client, echo_toolbox(), PRICE, max_turns=2).episode(task, 0, 0)
            )
            for name, client in clients.items()
        }
    for name, trajectory in trajectories.items():
        assert trajectory.termination == "engine_error" and trajectory.answer is None, name
        (turn,) = trajectory.turns
        assert turn.finish_reason.startswith("error: OpenAIError") and turn.cost_usd == 0.0
        assert "sk-secret-123" not in json.dumps(trajectory.to_json())
    assert "after 2 attempts" in trajectories["500"].turns[0].finish_reason
    assert "HTTP 500" in trajectories["500"].turns[0].finish_reason
    assert "401" in trajectories["401"].turns[0].finish_reason
