"""Fuzzed boundaries (property-based): whatever a file, a model or a client hands in, the answer
is a result or the boundary's own error naming where, never another exception.

* the Toolbox's argument validation, over every built-in tool's schema (the offline tools and
  the offline ToolScale domains' tools): an error result, never an exception, and the tool is
  not run;
* task files, conversation files and domain task files: a :class:`DataError` naming file and
  line, or the records;
* the reward server's inputs: a ``BadRequest`` for an unusable item; a parsed one is scored;
* a tool server's inputs (arguments and context): a ``BadRequest``, or parsed.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.strategies import json_values

from nemo_orch import config as config_lib
from nemo_orch.data.conversations import read_conversations
from nemo_orch.data.domain_tasks import read_domain_tasks
from nemo_orch.data.jsonl import DataError
from nemo_orch.data.tasks import read_tasks
from nemo_orch.rollout.builders import build_toolbox
from nemo_orch.serve.triton import BadRequest
from nemo_orch.tools.base import ToolContext, ToolResult
from nemo_orch.tools.schema import argument_errors

KEYS = [
    "id",
    "question",
    "answer",
    "system",
    "tools",
    "metadata",
    "allowed_documents",
    "messages",
    "role",
    "content",
    "tool_calls",
    "function",
    "name",
    "arguments",
    "type",
    "parameters",
    "gold_actions",
    "facts",
    "instruction",
    "domain",
    "scorer",
    "domain_task",
    "code",
    "query",
    "model",
    "text",
    "calls",
    "has_reference",
    "user_scenario",
    "evaluation_criteria",
    "actions",
]
values = json_values(
    KEYS,
    [
        "user",
        "assistant",
        "tool",
        "database",
        "exact",
        "shop",
        "python_sandbox",
        "search",
        "call_expert",
        "math-small",
    ],
    allow_nan=True,
)
records = st.one_of(values, st.dictionaries(st.sampled_from(KEYS), values, max_size=8))
lines = st.lists(st.one_of(records.map(json.dumps), st.text(max_size=40)), max_size=5)
FUZZ = settings(
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def toolbox(toolscale_dir):
    domains = [str(path) for path in sorted(toolscale_dir.glob("*/domain.json"))]
    config = config_lib.load([f"tools.domains=[{','.join(domains)}]"])
    return build_toolbox(config.tools)  # not started: a call that validates would run a tool


@FUZZ
@given(data=st.data())
def test_arguments_of_any_shape_against_every_builtin_schema(toolbox, data):
    name = data.draw(st.sampled_from(sorted(toolbox.tools)))
    properties = list(toolbox.tools[name].spec.parameters.get("properties", {}))
    arguments = data.draw(
        st.dictionaries(
            st.one_of(st.sampled_from(properties or ["x"]), st.text(max_size=8)), values, max_size=5
        )
    )
    problems = argument_errors(toolbox.tools[name].spec.parameters, arguments)
    assert isinstance(problems, list)
    if problems:
        result = asyncio.run(toolbox.call(name, arguments))
        assert isinstance(result, ToolResult) and result.error.startswith("invalid arguments")


@FUZZ
@given(lines=lines, reader=st.sampled_from([read_tasks, read_conversations, read_domain_tasks]))
def test_record_files_read_or_name_the_bad_line(tmp_path_factory, lines, reader):
    path = tmp_path_factory.mktemp("records") / "file.jsonl"
    path.write_text("\n".join(lines) + "\n")
    try:
        assert isinstance(reader(path), list)
    except DataError as error:
        assert str(path) in str(error)


@pytest.fixture(scope="module")
def reward():
    from nemo_orch.serve.triton_models import reward_model

    return reward_model(config_lib.load())


item_fields = st.fixed_dictionaries(
    {
        "problem": st.text(max_size=20),
        "prediction": st.text(max_size=20),
        "reference": st.text(max_size=20),
        "metadata": st.one_of(
            st.text(max_size=20),
            records.map(json.dumps),
            st.fixed_dictionaries(
                {"id": st.text(max_size=5)},
                optional={"metadata": values, "calls": values, "has_reference": values},
            ).map(json.dumps),
        ),
    }
)


@FUZZ
@given(item=item_fields)
def test_reward_server_items_are_refused_or_scored(reward, item):
    try:
        parsed = reward.parse(item)
    except BadRequest:
        return
    (answer,) = asyncio.run(reward.run([parsed]))
    assert set(answer) >= {"score", "correct", "method", "detail"}


@pytest.fixture(scope="module")
def served_tool(toolbox):
    from nemo_orch.serve.triton_models import tool_model

    return tool_model(toolbox, "search")


CONTEXT_KEYS = ["task_id", "episode_id", "seed", "allowed_documents", "observations", "task"]
tool_fields = st.fixed_dictionaries(
    {
        "arguments": st.one_of(st.text(max_size=20), records.map(json.dumps)),
        "context": st.one_of(
            st.text(max_size=20),
            records.map(json.dumps),
            st.dictionaries(st.sampled_from(CONTEXT_KEYS), values, max_size=4).map(json.dumps),
        ),
    }
)


@FUZZ
@given(item=tool_fields)
@example(item={"arguments": "{}", "context": '{"seed": Infinity}'})
def test_tool_server_items_are_refused_or_parsed(served_tool, item):
    try:
        arguments, context = served_tool.parse(item)
    except BadRequest:
        return
    assert isinstance(arguments, dict) and isinstance(context, ToolContext)
