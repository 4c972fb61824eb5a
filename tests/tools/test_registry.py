"""Declarations load from files; the toolbox validates, bounds, times out, caches and never
raises."""

from __future__ import annotations

import asyncio
import time

import pytest
import yaml
from support.fixture_tools import ECHO_PARAMETERS, DelayedEcho, echo_spec

from nemo_orch.tools.base import Pricing, ToolContext, ToolError
from nemo_orch.tools.registry import Toolbox, load_declaration, load_toolbox


def declare(directory, name="echo", **extra):
    body = {
        "name": name,
        "description": "Echo the text back.",
        "parameters": ECHO_PARAMETERS,
        "class": "support.fixture_tools.DelayedEcho",
        **extra,
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_a_tool_is_a_file(tmp_path):
    declare(
        tmp_path,
        "echo",
        pricing={"per_call": 0.01},
        options={"prefix": ">"},
        deterministic=True,
        max_concurrency=2,
        timeout_s=3,
    )
    declare(tmp_path, "shout", options={"prefix": "!"})
    toolbox = load_toolbox([tmp_path])
    assert [s["function"]["name"] for s in toolbox.schemas()] == ["echo", "shout"]
    spec = toolbox.specs["echo"]
    assert spec.pricing == Pricing(per_call=0.01) and spec.deterministic
    assert spec.max_concurrency == 2 and spec.timeout_s == 3
    result = asyncio.run(toolbox.call("echo", {"text": "hi"}))
    assert result.output == ">hi" and result.error is None and result.cost_usd == 0.01


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"name": "x", "parameters": ECHO_PARAMETERS, "class": "a.B"},
            "missing keys ['description']",
        ),
        ({"name": "x", "description": "d", "parameters": ECHO_PARAMETERS}, "exactly one of"),
        (
            {
                "name": "x",
                "description": "d",
                "parameters": ECHO_PARAMETERS,
                "class": "a.B",
                "colour": 1,
            },
            "unknown keys ['colour']",
        ),
        (
            {"name": "x y", "description": "d", "parameters": ECHO_PARAMETERS, "class": "a.B"},
            "must be an identifier",
        ),
        (
            {"name": "x", "description": "d", "parameters": {"type": "string"}, "class": "a.B"},
            "type object",
        ),
        (
            {
                "name": "x",
                "description": "d",
                "parameters": ECHO_PARAMETERS,
                "class": "a.B",
                "pricing": {"per_call": -1},
            },
            "pricing.per_call must be >= 0",
        ),
    ],
)
def test_bad_declarations_name_the_file_and_key(tmp_path, body, message):
    path = tmp_path / "tool.yaml"
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(ToolError, match="tool.yaml") as error:
        load_declaration(path)
    assert message in str(error.value)


def test_build_errors(tmp_path):
    declare(tmp_path, "echo", **{"class": "support.fixture_tools.Missing"})
    with pytest.raises(ToolError, match="cannot import 'support.fixture_tools.Missing'"):
        load_toolbox([tmp_path])
    (tmp_path / "echo.yaml").unlink()
    declare(tmp_path, "echo", options={"volume": 11})
    with pytest.raises(ToolError, match="cannot build support.fixture_tools.DelayedEcho"):
        load_toolbox([tmp_path])
    with pytest.raises(ToolError, match="no such tool declaration"):
        load_toolbox([tmp_path / "absent.yaml"])


def test_duplicate_names(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    declare(first), declare(second)
    with pytest.raises(ToolError, match="declared twice"):
        load_toolbox([first, second])


def test_every_failure_is_an_error_result():
    toolbox = Toolbox([DelayedEcho(echo_spec(timeout_s=0.2))])

    async def calls():
        return await asyncio.gather(
            toolbox.call("nope", {}),
            toolbox.call("echo", {"text": 1}),
            toolbox.call("echo", {"txt": "a"}),
            toolbox.call("echo", {"text": "raise"}),
            toolbox.call("echo", {"text": "slow", "delay_s": 5}),
            toolbox.call("echo", {"text": "fine"}),
        )

    unknown, mistyped, misnamed, raised, slow, fine = asyncio.run(calls())
    assert "unknown tool 'nope'" in unknown.error
    assert "'text' should be of type string" in mistyped.error
    assert (
        "missing argument 'text'" in misnamed.error
        and "undeclared argument 'txt'" in misnamed.error
    )
    assert raised.error == "echo failed: RuntimeError: asked to fail"
    assert slow.error == "echo timed out after 0.2 s" and slow.latency_s >= 0.2
    assert fine.error is None and fine.output == "fine"
    # The policy's mistakes are its tool errors; a tool that broke or hung is the
    # infrastructure's, and the observation says which.
    assert [r.kind for r in (unknown, mistyped, misnamed, raised, slow, fine)] == [
        "tool_error"
    ] * 3 + ["infra_error"] * 2 + ["ok"]
    assert fine.observation == "fine" and mistyped.observation.startswith("Error: ")
    assert raised.observation.startswith(
        "Unavailable (infrastructure failure, not the call's fault): echo failed"
    )


def test_deterministic_results_are_cached_and_still_reported():
    tool = DelayedEcho(echo_spec(deterministic=True, pricing=Pricing(per_call=0.5)))
    toolbox = Toolbox([tool], cache_entries=2)
    run = lambda text, docs=None: asyncio.run(  # noqa: E731
        toolbox.call("echo", {"text": text}, ToolContext(allowed_documents=docs))
    )
    first, again = run("a"), run("a")
    assert (first.cached, first.cost_usd) == (False, 0.5)
    assert (again.cached, again.cost_usd, again.output) == (True, 0.0, "a")
    assert tool.calls == 1
    run("a", frozenset({"d1"}))  # another whitelist is another key
    assert tool.calls == 2
    run("b"), run("c")  # evicts "a" (LRU, 2 entries)
    run("a")
    assert tool.calls == 5 and len(toolbox.cache) == 2
    run("raise"), run("raise")  # failures are not cached
    assert tool.calls == 7


def test_cache_is_bounded_in_bytes():
    toolbox = Toolbox([DelayedEcho(echo_spec(deterministic=True))], cache_bytes=10)
    for text in ("aaaa", "bbbb", "cccc", "x" * 11):
        asyncio.run(toolbox.call("echo", {"text": text}))
    assert len(toolbox.cache) == 2 and toolbox.cache._bytes == 8


def test_per_tool_concurrency_bound_and_independence():
    slow = DelayedEcho(echo_spec("slow", max_concurrency=2), default_delay_s=0.3)
    fast = DelayedEcho(echo_spec("fast"))
    toolbox = Toolbox([slow, fast])

    async def scenario():
        await toolbox.start()
        start = time.perf_counter()
        slow_calls = [asyncio.create_task(toolbox.call("slow", {"text": str(i)})) for i in range(4)]
        await toolbox.call("fast", {"text": "now"})
        fast_done = time.perf_counter() - start
        await asyncio.gather(*slow_calls)
        return fast_done, time.perf_counter() - start

    fast_done, all_done = asyncio.run(scenario())
    assert slow.started and fast.started
    assert slow.max_running == 2  # the bound held
    assert all_done >= 0.6  # 4 calls, 2 at a time, 0.3 s each
    assert fast_done < 0.25  # the other tool did not wait behind them


def test_simulated_latency_delays_every_call_that_runs():
    toolbox = Toolbox([DelayedEcho(echo_spec())], simulated_latency_s=0.3)

    async def scenario():
        started = time.perf_counter()
        results = await asyncio.gather(
            *(toolbox.subset(["echo"]).call("echo", {"text": str(i)}) for i in range(3))
        )
        return results, time.perf_counter() - started

    results, seconds = asyncio.run(scenario())
    assert [result.output for result in results] == ["0", "1", "2"]
    assert all(result.latency_s >= 0.3 for result in results)  # the ledger shows the wait
    assert seconds >= 0.3  # the calls waited side by side, not one after another
    # tools.simulated_latency_s reaches the main job's toolbox; a negative one is refused.
    from nemo_orch import config as config_lib
    from nemo_orch.config import ConfigError
    from nemo_orch.rollout.builders import build_toolbox

    assert (
        build_toolbox(config_lib.load(["tools.simulated_latency_s=0.5"]).tools).simulated_latency_s
        == 0.5
    )
    with pytest.raises(ConfigError, match="tools.simulated_latency_s must be >= 0"):
        config_lib.load(["tools.simulated_latency_s=-1"])


def test_modeled_time_takes_each_calls_seconds_from_the_tool_not_the_clock():
    spec = echo_spec(latency_hint_s=0.25, timeout_s=0.2)
    modeled = Toolbox([DelayedEcho(spec)], modeled_time=True).subset(["echo"])

    async def scenario(toolbox):
        return await asyncio.gather(
            toolbox.call("echo", {"text": "a", "delay_s": 0.05}),
            toolbox.call("echo", {"text": "raise"}),
            toolbox.call("echo", {"text": "b", "delay_s": 1.0}),
        )

    done, raised, timed_out = asyncio.run(scenario(modeled))
    assert done.output == "a" and "asked to fail" in raised.error and "timed out" in timed_out.error
    assert [r.latency_s for r in (done, raised, timed_out)] == [0.25] * 3
    measured = asyncio.run(scenario(Toolbox([DelayedEcho(spec)])))
    assert 0.05 <= measured[0].latency_s < 0.25 and measured[2].latency_s >= 0.2
    # The offline worlds' tools are modeled (tools.timing), a deployment's measured.
    from nemo_orch import config as config_lib
    from nemo_orch.config import ConfigError
    from nemo_orch.rollout.builders import build_toolbox

    assert build_toolbox(config_lib.load([]).tools).modeled_time
    assert not build_toolbox(config_lib.load(["tools=experts"]).tools).modeled_time
    with pytest.raises(ConfigError, match="tools.timing must be measured|modeled"):
        config_lib.load(["tools.timing=clock"])


def test_subset_shares_instances_and_rejects_unknown():
    echo = DelayedEcho(echo_spec())
    toolbox = Toolbox([echo, DelayedEcho(echo_spec("other"))])
    assert toolbox.subset(["echo"]).tools == {"echo": echo}
    with pytest.raises(ToolError, match="unknown tools"):
        toolbox.subset(["missing"])


def test_offered_tools_show_their_models_prices_from_the_price_table():
    """The main job's composites list each model alias's price (description, schema, the
    compact signature), from the table in force: a repriced table shows its prices; with
    ``tools.show_prices=false`` only the aliases."""
    from nemo_orch import config as config_lib
    from nemo_orch.models.tokenizer import render_conversation
    from nemo_orch.rollout.builders import offered_schemas

    def answer_schema(*overrides):
        schemas = offered_schemas(config_lib.load(list(overrides)).tools)
        return next(s["function"] for s in schemas if s["function"]["name"] == "answer")

    listed = answer_schema()
    assert listed["parameters"]["properties"]["model"]["prices"]["answer-1"] == [1.25, 10.0]
    assert listed["description"].endswith("The model prices: USD per million input/output tokens.")
    signature = render_conversation(
        [{"role": "user", "content": "q"}],
        [{"type": "function", "function": listed}],
        chat_format="compact",
    ).splitlines()[2]
    assert signature.startswith("answer(model: answer-1 $10|answer-2 $2|answer-3 $0.9|")
    repriced = answer_schema("tools=offline_repriced")
    assert repriced["parameters"]["properties"]["model"]["prices"]["answer-2"] == [0.75, 6.0]
    hidden = answer_schema("tools.show_prices=false")
    assert "prices" not in hidden["parameters"]["properties"]["model"]
    assert "prices" not in hidden["description"]
