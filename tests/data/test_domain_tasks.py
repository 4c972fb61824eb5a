"""The ToolScale / tau2 Task schema (round trips, bad files), scoring, and the validation
filters."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from nemo_orch.data.domain_tasks import (
    DomainTask,
    gold_calls,
    read_domain_tasks,
    score_episode,
    to_task_row,
    write_domain_tasks,
)
from nemo_orch.data.jsonl import DataError
from nemo_orch.envs.toolscale.domain_records import generate_domain
from nemo_orch.envs.toolscale.generator import generate_tasks
from nemo_orch.envs.toolscale.validate import ValidationSummary, rejection, validated


@pytest.fixture(scope="module")
def shop():
    return generate_domain("shop", seed=0)


@pytest.fixture(scope="module")
def tasks(shop):
    return list(itertools.islice(generate_tasks(shop, seed=0), 60))


def task(shop, actions, facts=(), task_id="t"):
    return DomainTask.model_validate(
        {
            "id": task_id,
            "user_scenario": {
                "instructions": {"domain": "shop", "reason_for_call": "r", "task_instructions": "i"}
            },
            "evaluation_criteria": {
                "actions": [
                    {"action_id": str(n), "name": name, "arguments": arguments}
                    for n, (name, arguments) in enumerate(actions)
                ],
                "communicate_info": list(facts),
            },
        }
    )


def pending_order(shop) -> str:
    return next(o["order_id"] for o in shop.database["orders"].values() if o["status"] == "pending")


def test_round_trip_jsonl_and_json_array(tasks, tmp_path):
    jsonl = tmp_path / "tasks.jsonl"
    assert write_domain_tasks(jsonl, tasks) == len(tasks)
    assert [t.to_json() for t in read_domain_tasks(jsonl)] == [t.to_json() for t in tasks]
    array = tmp_path / "tasks.json"
    array.write_text(json.dumps([t.to_json() for t in tasks], indent=2))
    assert [t.to_json() for t in read_domain_tasks(array)] == [t.to_json() for t in tasks]


def test_published_forms_load_as_they_are(tmp_path):
    """tau2's fields (persona, ticket, initial_state, nl_assertions, reward_basis), nested
    objects stored as JSON strings (as in the ToolScale parquet) and unknown fields, kept."""
    record = {
        "id": "0",
        "description": json.dumps({"purpose": "p", "relevant_policies": None}),
        "user_scenario": {
            "persona": "calm",
            "instructions": {
                "domain": "retail",
                "reason_for_call": "refund",
                "known_info": "zip 1",
                "unknown_info": None,
                "task_instructions": "be brief",
            },
        },
        "ticket": None,
        "initial_state": {"initialization_data": {"agent_data": {"orders": {}}}},
        "evaluation_criteria": json.dumps(
            {
                "actions": [
                    {
                        "action_id": "0_0",
                        "name": "get_order_details",
                        "arguments": {"order_id": "#W1"},
                        "info": None,
                    }
                ],
                "communicate_info": ["10"],
                "nl_assertions": ["polite"],
                "reward_basis": ["DB", "ACTION"],
            }
        ),
        "source": "toolscale-v1",
    }
    path = tmp_path / "public.json"
    path.write_text(json.dumps([record]))
    loaded = read_domain_tasks(path)[0]
    assert loaded.description.purpose == "p" and loaded.domain_name == "retail"
    assert loaded.evaluation_criteria.reward_basis == ["DB", "ACTION"]
    assert loaded.gold_actions[0].requestor == "assistant"
    assert loaded.to_json()["source"] == "toolscale-v1"
    assert loaded.database_update() == {"orders": {}}
    assert (
        read_domain_tasks(path)[0].to_json()
        == DomainTask.model_validate(loaded.to_json()).to_json()
    )


def test_malformed_files_name_file_and_line(tasks, tmp_path):
    good = json.dumps(tasks[0].to_json())
    jsonl = tmp_path / "bad.jsonl"
    missing = tasks[1].to_json()
    del missing["user_scenario"]
    jsonl.write_text(f"{good}\n\n{json.dumps(missing)}\n")
    with pytest.raises(DataError, match=r"bad.jsonl:3: user_scenario: Field required"):
        read_domain_tasks(jsonl)
    jsonl.write_text(f"{good}\n{{not json\n")
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        read_domain_tasks(jsonl)
    jsonl.write_text(f"{good}\n{good}\n")
    with pytest.raises(DataError, match="bad.jsonl:2: duplicate task id"):
        read_domain_tasks(jsonl)
    array = tmp_path / "bad.json"
    wrong = tasks[2].to_json()
    wrong["evaluation_criteria"]["actions"][0]["arguments"] = "oops"
    array.write_text(json.dumps([tasks[0].to_json(), wrong], indent=2))
    line = [n for n, text in enumerate(array.read_text().splitlines(), 1) if text == "  {"][1]
    with pytest.raises(DataError, match=rf"bad.json:{line}: evaluation_criteria.actions.0"):
        read_domain_tasks(array)
    array.write_text("[\n")
    with pytest.raises(DataError, match="bad.json:1: not valid JSON|no tasks"):
        read_domain_tasks(array)


def test_gold_scores_one_and_a_wrong_argument_scores_zero(shop, tasks):
    for drawn in tasks:
        assert score_episode(shop, drawn, gold_calls(drawn), " ".join(drawn.facts)).reward == 1.0
    order = pending_order(shop)
    cancel = task(
        shop,
        [("get_order_details", {"order_id": order}), ("cancel_pending_order", {"order_id": order})],
    )
    other = next(
        o
        for o in shop.database["orders"]
        if shop.database["orders"][o]["status"] == "pending" and o != order
    )
    wrong = score_episode(shop, cancel, [("cancel_pending_order", {"order_id": other})], "")
    assert (wrong.reward, wrong.db_match, wrong.writes) == (0.0, False, True)
    nothing = score_episode(shop, cancel, [], "I cancelled it.")
    assert nothing.reward == 0.0
    # A refused call changes nothing: the state is as if it were never made.
    refused = score_episode(
        shop,
        cancel,
        [("cancel_pending_order", {"order_id": 12}), ("cancel_pending_order", {"order_id": order})],
        "",
    )
    assert refused.reward == 1.0


def test_no_write_task_is_flagged_and_rests_on_facts(shop):
    credit = shop.database["customers"]["C1"]["store_credit"]
    read_only = task(shop, [("get_customer_details", {"customer_id": "C1"})], facts=[f"{credit:g}"])
    silent = score_episode(shop, read_only, [], "I don't know.")
    assert silent.writes is False and silent.db_match and silent.reward == 0.0
    assert silent.missing_facts == [f"{credit:g}"]
    told = score_episode(shop, read_only, [], f"You have ${credit:g} of credit.")
    assert told.reward == 1.0


def test_action_basis_requires_the_gold_calls(shop):
    order = pending_order(shop)
    record = task(shop, [("get_order_details", {"order_id": order})], facts=["x"]).to_json()
    record["evaluation_criteria"]["reward_basis"] = ["ACTION"]
    strict = DomainTask.model_validate(record)
    assert score_episode(shop, strict, [], "x").missing_actions == ["get_order_details"]
    assert (
        score_episode(shop, strict, [("get_order_details", {"order_id": order})], "").reward == 1.0
    )


def test_every_validation_filter(shop):
    order = pending_order(shop)
    delivered = next(o for o, r in shop.database["orders"].items() if r["status"] == "delivered")
    cases = {
        "schema": task(shop, [("cancel_pending_order", {"order_id": 5})]),
        "execution": task(shop, [("cancel_pending_order", {"order_id": delivered})]),
        "no_effect": task(
            shop,
            [
                ("add_store_credit", {"customer_id": "C1", "amount": 5}),
                ("add_store_credit", {"customer_id": "C1", "amount": -5}),
            ],
        ),
        "budget": task(
            shop,
            [("get_order_details", {"order_id": order})] * 12
            + [("cancel_pending_order", {"order_id": order})],
        ),
    }
    unknown_tool = task(shop, [("refund_everything", {})])
    judged = task(shop, [("cancel_pending_order", {"order_id": order})]).to_json()
    judged["evaluation_criteria"]["reward_basis"] = ["DB", "NL_ASSERTION"]
    judged["evaluation_criteria"]["nl_assertions"] = ["The agent is polite."]
    assert "needs an LLM judge" in rejection(shop, DomainTask.model_validate(judged), 12).reason
    read_nothing = task(shop, [("get_order_details", {"order_id": order})])
    for expected, drafted in cases.items():
        assert rejection(shop, drafted, max_actions=12).filter == expected
    assert rejection(shop, unknown_tool, 12).filter == "schema"
    assert "doing nothing would pass" in rejection(shop, read_nothing, 12).reason
    keep = task(shop, [("cancel_pending_order", {"order_id": order})], task_id="keep")
    summary = ValidationSummary()
    kept = list(validated(shop, [*cases.values(), unknown_tool, read_nothing, keep], 12, summary))
    assert [t.id for t in kept] == ["keep"]
    assert summary.dropped() == {"schema": 2, "execution": 1, "no_effect": 2, "budget": 1}
    assert (summary.seen, summary.kept) == (7, 1)


def test_task_row_for_the_orchestrator(shop, tasks):
    drawn = tasks[0]
    row = to_task_row(
        shop,
        drawn,
        preference={"accuracy": 1.0, "cost": 0.5},
        instruction="Keep it cheap.",
        extra_tools=("call_expert",),
    )
    assert row.id == f"shop/{drawn.id}" and row.system == shop.spec.policy
    assert row.question.endswith("Keep it cheap.")
    assert drawn.user_scenario.instructions.reason_for_call in row.question
    assert row.tools == (*shop.spec.tools, "call_expert")
    assert row.metadata["scorer"] == "database" and row.metadata["domain"] == "shop"
    assert row.metadata["difficulty"] == len(drawn.gold_actions)
    assert DomainTask.model_validate(row.metadata["domain_task"]).to_json() == drawn.to_json()
    assert row.metadata["preference"] == {"accuracy": 1.0, "cost": 0.5}


def test_generation_is_deterministic_and_graded(shop):
    first = [t.to_json() for t in itertools.islice(generate_tasks(shop, seed=3), 300)]
    again = [t.to_json() for t in itertools.islice(generate_tasks(shop, seed=3), 300)]
    other = [t.to_json() for t in itertools.islice(generate_tasks(shop, seed=4), 300)]
    assert first == again and first != other
    sizes = {len(t["evaluation_criteria"]["actions"]) for t in first}
    assert min(sizes) == 1 and max(sizes) >= 8
    assert generate_domain("shop", 0).database == generate_domain("shop", 0).database


@pytest.mark.tau2
def test_tau2_published_tasks_round_trip():
    """The tau2-bench retail and telecom task files load as they are and write back equal."""
    tau2 = pytest.importorskip("tau2")
    data = Path(tau2.__file__).parent / "data" / "tau2" / "domains"
    for domain in ("retail", "telecom"):
        path = data / domain / "tasks.json"
        original = json.loads(path.read_text())
        loaded = read_domain_tasks(path)
        assert len(loaded) == len(original)
        for raw, parsed in zip(original, loaded):
            assert parsed.to_json() == raw
