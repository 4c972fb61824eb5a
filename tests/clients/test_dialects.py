"""Endpoint dialects (nemo_orch/config/dialect.py): each preset asks as its servers take it,
against a SIMULATED OpenAI endpoint on 127.0.0.1 that refuses what OpenAI's reasoning models
refuse; a refused parameter is a configuration error that stops the run (exit 2) naming the
parameter and the endpoint, never an error observation; reasoning tokens are billed as output;
the shipped reference tools reach a reasoning model with the parameters it takes."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st
from support.cli_helpers import run_cli_here
from support.simulated_openai import ANSWER_TOKENS, REASONING_TOKENS, SimulatedOpenAI
from support.strategies import json_values

from nemo_orch import config as config_lib
from nemo_orch.clients.openai import EndpointRefusal, OpenAIClient, OpenAIError
from nemo_orch.config import ConfigError, RewardConfig, resolve_conf_path
from nemo_orch.config.dialect import DIALECT_PRESETS, Dialect, parse_dialect
from nemo_orch.data.tasks import Task
from nemo_orch.reward.outcome import OutcomeScorer
from nemo_orch.rollout.builders import build_toolbox
from nemo_orch.tools.base import ToolContext
from nemo_orch.tools.pricing import model_pricing
from nemo_orch.tools.registry import load_declarations, load_toolbox

KEY = "sk-SENTINEL-dialects-0123456789"
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def reasoning_model():
    with SimulatedOpenAI("gpt-5", reasoning=True, key=KEY) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def chat_model():
    with SimulatedOpenAI("gpt-4.1", reasoning=False, key=KEY) as endpoint:
        yield endpoint


@pytest.fixture(autouse=True)
def openai_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)


def ask(endpoint: SimulatedOpenAI, dialect, **sampling):
    client = OpenAIClient(
        endpoint.url,
        endpoint.model,
        dialect=dialect,
        name="test endpoint",
        api_key_env="OPENAI_API_KEY",
        max_retries=0,
    )
    return asyncio.run(client.chat(QUESTION, max_tokens=64, **sampling))


SAMPLING = {"temperature": 0.0, "top_p": 0.9, "stop": ["\n\n"], "seed": 7}


@pytest.mark.parametrize(
    "dialect, expected",
    [
        ("vllm", {"max_tokens": 64, **SAMPLING}),
        ("openai-chat", {"max_completion_tokens": 64, **SAMPLING}),
        ("openai-reasoning", {"max_completion_tokens": 64, "seed": 7}),
        (
            {
                "preset": "openai-reasoning",
                "reasoning_effort": "high",
                "extra_body": {"verbosity": "low"},
            },
            {
                "max_completion_tokens": 64,
                "seed": 7,
                "reasoning_effort": "high",
                "verbosity": "low",
            },
        ),
        (
            {"output_cap": "max_completion_tokens", "extra_body": {"top_k": 20}},
            {"max_completion_tokens": 64, **SAMPLING, "top_k": 20},
        ),
    ],
)
def test_each_dialect_asks_as_declared(chat_model, dialect, expected):
    chat_model.requests.clear()
    ask(chat_model, dialect, **SAMPLING)
    [request] = chat_model.requests
    assert request["body"] == {"model": "gpt-4.1", "messages": QUESTION, **expected}


def test_a_reasoning_model_answers_its_dialect_and_bills_its_reasoning(reasoning_model):
    reply = ask(reasoning_model, "openai-reasoning", **SAMPLING)
    assert reply.text == "4" and reply.reasoning_tokens == REASONING_TOKENS
    assert reply.output_tokens == REASONING_TOKENS + ANSWER_TOKENS  # reasoning is output


@pytest.mark.parametrize(
    "dialect, refused",
    [
        ("vllm", "max_tokens"),
        ("openai-chat", "temperature"),
        ({"preset": "openai-reasoning", "reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_a_refused_parameter_names_itself_and_the_endpoint(reasoning_model, dialect, refused):
    reasoning_model.requests.clear()
    with pytest.raises(EndpointRefusal) as raised:
        ask(reasoning_model, dialect, **SAMPLING)
    message = str(raised.value)
    assert message.startswith(
        f"test endpoint: the endpoint {reasoning_model.url} (model gpt-5) "
        f"refuses the request parameter {refused!r}"
    )
    assert "openai-reasoning" in message and KEY not in message
    assert len(reasoning_model.requests) == 1  # a refusal is not retried
    assert isinstance(raised.value, ConfigError) and not isinstance(raised.value, OpenAIError)


def test_other_refusals_stay_errors_of_the_call(reasoning_model):
    """A 400 naming no parameter the request sent (a context too long, an unknown model) fails
    that call only."""
    client = OpenAIClient(
        reasoning_model.url,
        "gpt-5",
        dialect="openai-reasoning",
        api_key_env="OPENAI_API_KEY",
        max_retries=0,
    )
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(client.request("POST", "embeddings", {"input": "x"}))
    assert not isinstance(raised.value, EndpointRefusal) and raised.value.status == 404


SENT = {"model": "gpt-5", "messages": [], "max_tokens": 64, "temperature": 0.0}
ERROR_WORDS = [
    "max_tokens",
    "temperature",
    "messages",
    "unsupported_parameter",
    "unsupported_value",
    "invalid_value",
    "Unsupported parameter: 'max_tokens'",
    "Unsupported value: 'messages'",
]


ERROR_FIELDS = ["error", "param", "code", "message", "type"]
# OpenAI's error body, its fields drawn from what a refusal names and anything else.
ERROR_BODIES = st.dictionaries(
    st.sampled_from(ERROR_FIELDS),
    json_values(ERROR_FIELDS, ERROR_WORDS, allow_nan=True),
    max_size=5,
).map(lambda error: {"error": error})


@given(
    status=st.sampled_from([400, 401, 404, 422]),
    body=st.one_of(
        st.binary(max_size=200),
        st.one_of(ERROR_BODIES, json_values(ERROR_FIELDS, ERROR_WORDS, allow_nan=True)).map(
            lambda value: json.dumps(value).encode()
        ),
    ),
)
@example(status=400, body=b'{"error": {"code": [], "param": ""}}')  # an unhashable code
def test_any_error_body_is_read_as_a_refusal_only_when_it_names_a_sent_setting(status, body):
    """Whatever a server answers, reading it never raises, and a refusal is a 400 naming a
    parameter the request sent other than the conversation."""
    client = OpenAIClient("http://127.0.0.1:9/v1", "gpt-5", name="fuzzed")
    refusal = client.refusal(httpx.Response(status, content=body), SENT)
    if refusal is not None:
        assert status == 400 and isinstance(refusal, EndpointRefusal)
        named = re.search(r"refuses the request parameter '(\w+)'", str(refusal))[1]
        assert named in SENT and named not in ("messages", "prompt")


def test_the_simulated_endpoint_refuses_as_openai_does_for_the_official_client(reasoning_model):
    """The simulated refusals read, through the official ``openai`` SDK, as OpenAI's do."""
    client = openai.OpenAI(base_url=reasoning_model.url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="gpt-5", messages=QUESTION, max_tokens=64)
    assert (raised.value.param, raised.value.code) == ("max_tokens", "unsupported_parameter")
    reply = client.chat.completions.create(
        model="gpt-5", messages=QUESTION, max_completion_tokens=64, reasoning_effort="low"
    )
    assert reply.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_bad_dialects_are_configuration_errors():
    assert parse_dialect("openai-reasoning", "x") == DIALECT_PRESETS["openai-reasoning"]
    assert parse_dialect({"reasoning_effort": "low"}, "x") == Dialect(reasoning_effort="low")
    for declared, message in (
        ("gpt", "unknown dialect preset 'gpt'"),
        ({"output_cap": "max_new_tokens"}, "output_cap must be one of"),
        ({"sampling": "no"}, "sampling must be true or false"),
        ({"stream": "yes"}, "stream must be true or false, got 'yes'"),
        ({"extra_body": {"max_tokens": 5}}, "extra_body may not set max_tokens"),
        ({"effort": "high"}, "unknown dialect field(s) effort"),
        (7, "a dialect is a preset's name"),
    ):
        with pytest.raises(ConfigError, match=f"^where: .*{re.escape(message)}"):
            parse_dialect(declared, "where")
    with pytest.raises(ConfigError, match="rollout.dialect: the policy is sampled"):
        config_lib.load(["rollout.dialect=openai-reasoning"])


def _expert_declaration(tmp_path, endpoint: SimulatedOpenAI, **options) -> str:
    path = tmp_path / f"ask_{len(options)}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "ask",
                "description": "Ask an expert.",
                "class": "nemo_orch.tools.llm.LLMTool",
                "parameters": {
                    "type": "object",
                    "required": ["model", "question"],
                    "properties": {"model": {"type": "string"}, "question": {"type": "string"}},
                },
                "options": {
                    "max_retries": 0,
                    "models": {
                        "frontier": {
                            "base_url": endpoint.url,
                            "model": "gpt-5",
                            "api_key_env": "OPENAI_API_KEY",
                            "max_tokens": 4096,
                            **options,
                        }
                    },
                },
            }
        )
    )
    return str(path)


def test_an_expert_tool_bills_reasoning_and_stops_the_run_on_a_refusal(tmp_path, reasoning_model):
    async def call(declaration: str):
        async with load_toolbox([declaration]) as toolbox:
            return await toolbox.call(
                "ask", {"model": "frontier", "question": "2 + 2?"}, ToolContext()
            )

    declared = _expert_declaration(tmp_path, reasoning_model, dialect="openai-reasoning")
    result = asyncio.run(call(declared))
    assert result.error is None and result.output == "4"
    assert result.usage.reasoning_tokens == REASONING_TOKENS
    assert result.cost_usd == pytest.approx(model_pricing("gpt-5").cost(result.usage, 0.0))
    assert result.usage.output_tokens == REASONING_TOKENS + ANSWER_TOKENS
    with pytest.raises(EndpointRefusal, match="^tool ask, model 'frontier': .*'max_tokens'"):
        asyncio.run(call(_expert_declaration(tmp_path, reasoning_model)))


def test_a_judge_that_refuses_its_dialect_stops_the_run(reasoning_model):
    task = Task(id="q", question="Capital of France?", answer="Paris")

    def scorer(dialect: str) -> OutcomeScorer:
        return OutcomeScorer(
            RewardConfig(
                judge_base_url=reasoning_model.url,
                judge_model="gpt-5",
                judge_api_key_env="OPENAI_API_KEY",
                judge_max_retries=0,
                judge_dialect=dialect,
            )
        )

    with pytest.raises(EndpointRefusal, match="^reward.judge: .*'max_tokens'"):
        asyncio.run(scorer("vllm").score(task, "The city of Paris, I think"))
    verdict = asyncio.run(scorer("openai-reasoning").score(task, "The city of Paris, I think"))
    assert verdict.method == "judge_error" and "no verdict" in verdict.detail  # it said "4"


def test_the_reference_tools_reach_a_reasoning_model_with_its_parameters(tmp_path, reasoning_model):
    """``tools=reference`` as shipped: answer-1 and reasoner-1 (gpt-5) ask the reasoning model
    with max_completion_tokens and no temperature; reasoner-1's program runs in the sandbox."""

    def reply(body: dict) -> str:
        asked = body["messages"][-1]["content"]
        return "```python\nprint(2 + 2)\n```" if "Python program" in asked else "<answer>4</answer>"

    with SimulatedOpenAI("gpt-5", reasoning=True, key=KEY, reply=reply) as gpt5:
        config = config_lib.load(
            [
                "tools=reference",
                f"+tools.endpoints.answer-1='{gpt5.url}'",
                f"+tools.endpoints.reasoner-1='{gpt5.url}'",
            ]
        )
        task = Task(id="sum", question="What is 2 + 2?", answer="4")

        async def plan():
            async with build_toolbox(config.tools) as toolbox:
                context = ToolContext(task_id=task.id, task=task)
                return [
                    await toolbox.call(name, {"model": model}, context)
                    for name, model in (("enhance_reasoning", "reasoner-1"), ("answer", "answer-1"))
                ]

        program, answer = asyncio.run(plan())
    assert program.error is None and "4" in program.output
    assert answer.error is None and answer.answer == "4"
    assert [request["body"]["model"] for request in gpt5.requests] == ["gpt-5", "gpt-5"]
    for request in gpt5.requests:
        assert request["auth"] == f"Bearer {KEY}"
        assert request["body"]["max_completion_tokens"] == 8192
        assert not {"max_tokens", "temperature", "top_p", "stop"} & request["body"].keys()


def test_a_run_whose_expert_refuses_exits_2_naming_it():
    """``nemo-orch tools call`` on ``tools=experts``: the math alias (an open model's server,
    vllm's dialect) pointed at a reasoning model is refused once; the command stops, exit 2."""
    with SimulatedOpenAI("gpt-5", reasoning=True, key=None) as reasoning_model:
        refused = run_cli_here(
            "tools",
            "call",
            "call_expert",
            "tools=experts",
            f"+tools.endpoints.math='{reasoning_model.url}'",
            "--args",
            json.dumps({"model": "math", "question": "2 + 2?"}),
            expect=2,
        )
    assert len(reasoning_model.requests) == 1
    assert "tool call_expert, model 'math'" in refused.stderr
    assert "refuses the request parameter 'max_tokens'" in refused.stderr


def test_every_shipped_openai_reasoning_model_is_asked_in_its_dialect():
    """The experts, reference and unseen sets: every real endpoint serving one of OpenAI's
    reasoning models declares ``openai-reasoning``; the others keep vllm's dialect."""
    declared = {}
    for name in ("experts", "reference", "unseen"):
        for declaration in load_declarations([resolve_conf_path(f"tools/{name}")]):
            if declaration.class_path == "nemo_orch.tools.llm.LLMTool":
                for alias, options in declaration.options["models"].items():
                    declared[f"{name}/{declaration.spec.name}/{alias}"] = (
                        options["model"],
                        parse_dialect(options.get("dialect", "vllm"), alias),
                    )
    reasoning = {key for key, (model, _) in declared.items() if re.match(r"gpt-5|o\d", model)}
    assert len(reasoning) == 7  # frontier; answer-1/2, reasoner-1/2, search-1/2
    assert all(
        (dialect == DIALECT_PRESETS["openai-reasoning"]) == (key in reasoning)
        for key, (_, dialect) in declared.items()
    )
