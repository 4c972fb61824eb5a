"""The tau2-bench adapter: tau2's tools behind our Toolbox, its tasks as our rows, and scoring by
tau2's own evaluator, down to a gold replay that must pass every train task."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("tau2")

from support.tau2_replay import gold_replay_turns  # noqa: E402

from nemo_orch.data.tasks import task_from_json  # noqa: E402
from nemo_orch.envs.interfaces import final_message  # noqa: E402
from nemo_orch.envs.tau2 import adapter  # noqa: E402
from nemo_orch.envs.tau2.adapter import (  # noqa: E402
    ASSISTANT,
    USER,
    ExecutedCall,
    Tau2Error,
    Turn,
    load_domain,
    score_episode,
)
from nemo_orch.tools.base import ToolContext  # noqa: E402

pytestmark = pytest.mark.tau2


@pytest.fixture(scope="module")
def retail():
    return load_domain("retail", "train")


@pytest.fixture(scope="module")
def telecom():
    return load_domain("telecom", "train")


def _task(domain, tau2_id):
    return next(task for task in domain.tasks if task.metadata["tau2_task"]["id"] == tau2_id)


def _context(task, episode="episode"):
    return ToolContext(task_id=task.id, episode_id=episode, task=task)


def _fresh_environment(domain_name):
    return adapter._tau2().registry.get_env_constructor(domain_name)()


def test_tool_specs_are_tau2s_schemas(retail, telecom):
    specs = retail.assistant_toolbox().specs
    assert specs["cancel_pending_order"].parameters["required"] == ["order_id", "reason"]
    assert specs["find_user_id_by_name_zip"].parameters["required"] == [
        "first_name",
        "last_name",
        "zip",
    ]
    environment = _fresh_environment("retail")
    for tool in environment.get_tools():
        function = tool.openai_schema["function"]
        assert specs[function["name"]].parameters == function["parameters"]
        assert specs[function["name"]].description == function["description"]
    assert retail.user_tools == []
    assistant, user = telecom.assistant_toolbox().specs, telecom.user_toolbox().specs
    assert {"get_customer_by_phone", "refuel_data"} <= assistant.keys()
    assert {"toggle_airplane_mode", "run_speed_test"} <= user.keys()
    assert not assistant.keys() & user.keys()


def test_tau2_tasks_become_task_rows(retail, telecom):
    assert len(retail.tasks) == 74 and len(telecom.tasks) == 74
    task = _task(retail, "0")
    assert task.id == "tau2-retail-0"
    assert task.system == retail.policy and "retail" in retail.policy.lower()
    assert task.tools == tuple(retail.assistant_toolbox().tools)
    assert "Reason for call: You received your order #W2378156" in task.question
    assert "Known info: You are Yusuf Rossi in zip code 19122." in task.question
    assert "Unknown info:" in task.question and "Task instructions:" in task.question
    assert task.metadata["benchmark"] == "tau2" and task.metadata["domain"] == "retail"
    assert task.metadata["tau2_task"]["evaluation_criteria"]["actions"][0]["name"] == (
        "find_user_id_by_name_zip"
    )
    # A row read back from a task file still carries everything scoring needs.
    reread = task_from_json(task.to_json(), "row")
    assert adapter.tau2_task_of(reread) == adapter.tau2_task_of(task)
    assert "<main_policy>" in telecom.policy


def test_a_call_through_our_toolbox_gives_tau2s_exact_output(retail):
    task = _task(retail, "0")
    toolbox = retail.assistant_toolbox()
    arguments = {"order_id": "#W2378156"}
    ours = asyncio.run(toolbox.call("get_order_details", arguments, _context(task)))
    environment = _fresh_environment("retail")
    expected = environment.to_json_str(environment.use_tool("get_order_details", **arguments))
    assert ours.error is None and ours.output == expected
    tool_call = adapter._tau2().message.ToolCall(
        name="get_order_details", arguments={"order_id": "#W0000000"}
    )
    missing = asyncio.run(
        toolbox.call("get_order_details", {"order_id": "#W0000000"}, _context(task))
    )
    tau2_message = environment.get_response(tool_call)
    assert tau2_message.error and missing.observation == tau2_message.content
    assert missing.error == "Order not found"
    retail.environments.release("episode", 0)


def test_each_episode_has_its_own_bounded_environment(retail):
    task, order_id = _task(retail, "0"), "#W4776164"  # a pending order of the task's user
    environments = adapter.episode_environments("retail", max_episodes=2)
    cancel, details = (
        adapter.Tau2Tool(retail.assistant_toolbox().specs[name], ASSISTANT, environments)
        for name in ("cancel_pending_order", "get_order_details")
    )

    async def status(episode):
        result = await details.call({"order_id": order_id}, _context(task, episode))
        return result.output

    cancelled = asyncio.run(
        cancel.call({"order_id": order_id, "reason": "no longer needed"}, _context(task, "a"))
    )
    assert cancelled.error is None and '"status": "cancelled"' in cancelled.output
    assert '"status": "cancelled"' in asyncio.run(status("a"))
    assert '"status": "pending"' in asyncio.run(status("b"))
    asyncio.run(status("c"))
    assert len(environments) == 2
    environments.release("c", 0)
    assert len(environments) == 1
    unknown = asyncio.run(details.call({"order_id": order_id}, ToolContext(episode_id="d")))
    assert "needs the task" in unknown.error


def test_a_wrong_order_id_in_a_write_action_scores_zero(retail):
    task = _task(retail, "0")
    turns = asyncio.run(gold_replay_turns(retail, task))
    assert score_episode(task, turns).reward == 1.0
    write = turns[-2].calls[0]
    assert write.name == "exchange_delivered_order_items"
    wrong_arguments = {**write.arguments, "order_id": "#W6247578"}  # another of the user's
    wrong = asyncio.run(
        retail.assistant_toolbox().call(write.name, wrong_arguments, _context(task, "wrong"))
    )
    retail.environments.release("wrong", 0)
    turns[-2] = Turn(ASSISTANT, calls=(ExecutedCall(write.name, wrong_arguments, wrong),))
    score = score_episode(task, turns)
    assert score.reward == 0.0 and not score.passed
    assert score.breakdown["components"]["DB"] == 0.0 and score.breakdown["db_match"] is False
    assert any("database" in failure for failure in score.failures)


def test_an_untold_fact_fails_the_communicate_check(retail):
    task = next(
        task
        for task in retail.tasks
        if task.metadata["tau2_task"]["evaluation_criteria"]["communicate_info"]
    )
    turns = asyncio.run(gold_replay_turns(retail, task))
    assert score_episode(task, turns).passed
    turns[-1] = Turn(ASSISTANT, text=final_message([]))
    score = score_episode(task, turns)
    assert score.reward == 0.0 and score.breakdown["components"]["COMMUNICATE"] == 0.0
    assert any(failure.startswith("not told to the user") for failure in score.failures)


def test_outputs_tau2_does_not_reproduce_fail_the_replay(retail):
    task = _task(retail, "0")
    turns = asyncio.run(gold_replay_turns(retail, task))
    call = turns[0].calls[0]
    forged = dataclasses.replace(call.result, output='"someone_else_1234"')
    turns[0] = Turn(ASSISTANT, calls=(dataclasses.replace(call, result=forged),))
    score = score_episode(task, turns)
    assert score.reward == 0.0 and "could not replay" in score.failures[0]


def test_user_tools_act_on_the_episode_environment(telecom):
    task = _task(
        telecom, "[mobile_data_issue]airplane_mode_on|user_abroad_roaming_enabled_off[PERSONA:None]"
    )
    turns = asyncio.run(gold_replay_turns(telecom, task))
    assert [turn.role for turn in turns] == [USER, USER, ASSISTANT]
    assert score_episode(task, turns).passed
    # Without the user's toggles the phone stays offline and tau2's assertions fail.
    score = score_episode(task, turns[-1:])
    assert score.reward == 0.0
    assert any(
        failure.startswith("assertion not met: user.assert_mobile_data_status")
        for failure in score.failures
    )


def test_a_task_with_message_history_starts_from_it(retail):
    """The history's calls are replayed into the episode's environment and prefix the scored
    trajectory (without them tau2's replay would miss the cancellation and the databases
    would differ)."""
    tau2 = adapter._tau2()
    message = tau2.message
    cancel = message.ToolCall(
        id="history_0",
        name="cancel_pending_order",
        arguments={"order_id": "#W4776164", "reason": "no longer needed"},
    )
    history = [
        message.UserMessage(role="user", content="Please cancel order #W4776164."),
        message.AssistantMessage(role="assistant", tool_calls=[cancel]),
        _fresh_environment("retail").get_response(cancel),
        message.AssistantMessage(role="assistant", content="Done. Anything else?"),
    ]
    tau2_task = adapter.tau2_task_of(_task(retail, "0")).model_copy(
        update={"initial_state": tau2.tasks.InitialState(message_history=history)}
    )
    task = adapter.to_task(tau2_task, "retail", retail.policy, retail.assistant_toolbox().tools)
    status = asyncio.run(
        retail.assistant_toolbox().call(
            "get_order_details", {"order_id": "#W4776164"}, _context(task, "history")
        )
    )
    retail.environments.release("history", 0)
    assert '"status": "cancelled"' in status.output
    messages = adapter.to_tau2_messages(tau2_task, [Turn(ASSISTANT, text="Bye.")])
    assert messages[:4] == history
    assert score_episode(task, asyncio.run(gold_replay_turns(retail, task))).passed


def _failed_gold_replays(domain):
    return [
        task.id
        for task in domain.tasks
        if not score_episode(task, asyncio.run(gold_replay_turns(domain, task))).passed
    ]


@pytest.mark.slow
def test_gold_replay_passes_every_retail_train_task(retail):
    assert len(retail.tasks) == 74 and _failed_gold_replays(retail) == []


def test_gold_replay_passes_every_telecom_train_task(telecom):
    assert len(telecom.tasks) == 74 and _failed_gold_replays(telecom) == []


def test_unknown_domain_or_split_is_a_clear_error():
    with pytest.raises(Tau2Error, match="unknown tau2 domain 'shopping'.*retail"):
        load_domain("shopping", "train")
    with pytest.raises(Tau2Error, match="no split 'dev'; splits: base, test, train"):
        load_domain("retail", "dev")


def test_missing_tau2_names_the_extra(monkeypatch):
    adapter._tau2.cache_clear()
    monkeypatch.setitem(sys.modules, "tau2.registry", None)
    try:
        with pytest.raises(Tau2Error, match=r"pip install 'nemo-orch\[tau2\]'"):
            adapter.domains()
    finally:
        adapter._tau2.cache_clear()


def test_the_episode_runner_on_tau2_is_scored_by_tau2(retail, tiny_tokenizer):
    """A scripted policy plays retail tasks through our episode runner and the domain's
    toolbox; tau2's evaluator scores the calls that reached its environment. A call its schema
    rejects reaches tau2 too, as in tau2's orchestrator: it fails with tau2's own error, stays
    in the transcript, and tau2 scores the episode with it (here: still solved)."""
    from support.scripted_plans import follow_plan, with_plan

    from nemo_orch.config import RolloutConfig
    from nemo_orch.rollout.engines.scripted import ScriptedEngine
    from nemo_orch.rollout.runner import run_rollouts

    tasks = [_task(retail, "0"), _task(retail, "1")]
    rows = []
    for task in tasks:
        criteria = adapter.tau2_task_of(task).evaluation_criteria
        calls = [(action.name, action.arguments) for action in criteria.actions]
        calls.insert(0, ("get_order_details", {"order": "#W1"}))  # no order_id: tau2 fails it
        rows.append(with_plan(task, calls, final_message(criteria.communicate_info or [])))
    rows.append(
        dataclasses.replace(with_plan(tasks[0], [], "Nothing to do."), id=f"{tasks[0].id}-idle")
    )
    settings = RolloutConfig(
        max_context_tokens=1 << 15, max_turns=12, max_new_tokens=512, check_template=False
    )
    trajectories = asyncio.run(
        run_rollouts(
            rows,
            1,
            ScriptedEngine(tiny_tokenizer, follow_plan),
            retail.assistant_toolbox(),
            tiny_tokenizer,
            settings,
        )
    )
    assert [t.termination for t in trajectories] == ["answer"] * 3
    tau2s_error = "RetailTools.get_order_details() got an unexpected keyword argument 'order'"
    assert trajectories[0].turns[0].calls[0].error == tau2s_error
    scores, transcripts = [], []
    for row, trajectory in zip(rows, trajectories):
        episode_id = f"{row.id}#0"
        transcripts.append(
            adapter.recorded_turns(retail, row, episode_id, trajectory.seed, trajectory.answer)
        )
        scores.append(score_episode(row, transcripts[-1]))
        retail.environments.release(episode_id, trajectory.seed)
    assert [score.reward for score in scores] == [1.0, 1.0, 0.0]
    first = transcripts[0][0].calls[0]
    assert (first.name, first.arguments, first.result.error) == (
        "get_order_details",
        {"order": "#W1"},
        tau2s_error,
    )
    assert len(transcripts[-1]) == 1  # the idle episode reached tau2 with no call


def test_tau2s_tasks_converted_as_the_hub_converts_them_read_back_unchanged(retail, tmp_path):
    """A domain's tasks as tau2's JSON, converted to parquet as the Hub's conversion does
    (pyarrow's JSON reader: one union struct per nested object, date strings typed as
    timestamps), read back by the task-file reader: every task equals tau2's own."""
    import json

    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    originals = [adapter.tau2_task_of(task) for task in retail.tasks]
    lines = tmp_path / "tasks.jsonl"
    lines.write_text("".join(json.dumps(task.model_dump(mode="json")) + "\n" for task in originals))
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa_json.read_json(lines), path)
    tools = {
        tool.spec.name: tool.spec.parameters
        for tool in [*retail.assistant_tools, *retail.user_tools]
    }
    read = adapter.read_task_file(path, "retail", tools)
    assert [task.model_dump(mode="json") for task in read] == [
        task.model_dump(mode="json") for task in originals
    ]
