"""ToolScale as published: a parquet file of tau2 ``Task`` structs, written here with pyarrow in
the published layout (one merged ``arguments`` struct, typed argument columns, null
``initial_state``), read back into the offline domains' tasks; other domains are counted."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.published_rows import published_schema

from nemo_orch.data.domain import Domain
from nemo_orch.data.domain_tasks import DomainTask, gold_calls, read_domain_tasks
from nemo_orch.data.jsonl import DataError
from nemo_orch.envs.toolscale.domain_specs import DOMAINS
from nemo_orch.envs.toolscale.generator import MAX_ACTIONS, write_offline
from nemo_orch.envs.toolscale.parquet import installed_domains, read_toolscale_parquet
from nemo_orch.envs.toolscale.validate import rejection

TIMESTAMP = pa.timestamp("s")
# Arguments of a bank domain, not installed here, typed as in the published file.
BANK = {
    "account_id": pa.string(),
    "start_date": TIMESTAMP,
    "end_date": TIMESTAMP,
    "min_amount": pa.float64(),
    "active_only": pa.bool_(),
}
# Date strings typed as timestamps (as pyarrow's JSON reader types them), and an integer
# argument in a float64 column (as when another domain's argument of that name is a float).
TYPED = {"date": TIMESTAMP, "birth_date": TIMESTAMP, "quantity": pa.float64()}
_JSON_TYPES = {"string": pa.string(), "number": pa.float64(), "integer": pa.int64()}


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("domains")
    write_offline(directory, tasks_per_domain=3, seed=0)
    return directory


@pytest.fixture(scope="module")
def domains(offline) -> dict[str, Domain]:
    return installed_domains(offline)


@pytest.fixture(scope="module")
def originals(offline) -> dict[str, list[DomainTask]]:
    return {name: read_domain_tasks(offline / name / "tasks.jsonl") for name in DOMAINS}


def schema(domains: dict[str, Domain]) -> pa.Schema:
    """The published schema, its ``arguments`` struct merging every tool's arguments."""
    fields = dict(BANK)
    for domain in domains.values():
        for tool in domain.spec.tools:
            for key, prop in domain.spec.parameters(tool)["properties"].items():
                fields.setdefault(key, TYPED.get(key, _JSON_TYPES[prop["type"]]))
    return published_schema(pa.struct(sorted(fields.items())))


def published(key: str, value: Any) -> Any:
    if TYPED.get(key) == TIMESTAMP:
        return datetime.datetime.fromisoformat(value)
    return float(value) if key == "quantity" else value


def row(task: DomainTask) -> dict[str, Any]:
    """A task as a published row (the struct fills in every key it lacks as null)."""
    record = task.to_json()
    for number, action in enumerate(record["evaluation_criteria"]["actions"]):
        action["arguments"] = {
            key: published(key, value) for key, value in action["arguments"].items()
        }
        if number == 0:
            action["requestor"] = "assistant"
    return record


def other_row(
    task_id: str, domain: str, actions: list[dict[str, Any]], reason: str | None = "r"
) -> dict[str, Any]:
    return {
        "id": task_id,
        "description": {"purpose": ""},
        "user_scenario": {
            "instructions": {"task_instructions": "i", "domain": domain, "reason_for_call": reason}
        },
        "evaluation_criteria": {"actions": actions, "communicate_info": []},
    }


BANK_ACTION = {
    "action_id": "0",
    "name": "list_transactions",
    "arguments": {
        "account_id": "AC1",
        "start_date": datetime.datetime(2025, 1, 1),
        "end_date": datetime.datetime(2025, 1, 31, 23, 59, 59),
        "min_amount": 20.5,
        "active_only": True,
    },
}


def write(path: Path, domains: dict[str, Domain], rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema(domains)), path)
    return path


@pytest.fixture(scope="module")
def published_file(tmp_path_factory, domains, originals) -> Path:
    shop, clinic, mobile = (originals[name] for name in ("shop", "clinic", "mobile"))
    rows = [
        row(shop[0]),
        other_row("9931", "bank", [BANK_ACTION]),
        row(clinic[0]),
        row(shop[1]),
        other_row("2023", "weather", []),
        row(mobile[0]),
        row(clinic[1]),
        # a bank row that would not parse: never parsed, only counted
        other_row("10315", "bank", [BANK_ACTION], reason=None),
        row(mobile[1]),
        row(shop[2]),
        row(clinic[2]),
        row(mobile[2]),
    ]
    return write(
        tmp_path_factory.mktemp("toolscale") / "train-00000-of-00001.parquet", domains, rows
    )


def test_the_layout_is_the_published_one(published_file):
    arguments = pq.read_table(published_file).to_pylist()[0]["evaluation_criteria"]["actions"][0][
        "arguments"
    ]
    assert len(arguments) == 30 and sum(value is not None for value in arguments.values()) == 3
    assert pq.read_schema(published_file).field("initial_state").type == pa.null()


def test_rows_become_the_tasks_they_were(published_file, domains, originals):
    loaded = read_toolscale_parquet(published_file, domains)
    for name, tasks in originals.items():
        read = loaded.tasks[name]
        assert [task.id for task in read] == [task.id for task in tasks]
        for got, want in zip(read, tasks):
            # null keys of other tools dropped, dates back as strings, quantity an integer
            assert gold_calls(got) == gold_calls(want)
            assert (got.facts, got.scenario_text()) == (want.facts, want.scenario_text())
            assert got.initial_state is None and got.user_scenario.persona is None
            assert got.evaluation_criteria.reward_basis == ["DB", "COMMUNICATE"]
            # the gold actions replay on the domain's database: the task passes every filter
            assert rejection(domains[name], got, MAX_ACTIONS) is None
    booked = next(
        a.arguments for a in loaded.tasks["clinic"][0].gold_actions if a.name == "book_appointment"
    )
    assert isinstance(booked["date"], str) and booked["date"].startswith("2026-")
    ordered = next(
        a.arguments for a in loaded.tasks["shop"][1].gold_actions if a.name == "place_order"
    )
    assert type(ordered["quantity"]) is int


def test_rows_are_counted_by_domain_and_uninstalled_ones_named(published_file, domains):
    loaded = read_toolscale_parquet(published_file, domains)
    assert loaded.counts == {"bank": 2, "clinic": 3, "mobile": 3, "shop": 3, "weather": 1}
    assert loaded.skipped == {"bank": 2, "weather": 1}
    assert loaded.to_json() == {
        "path": str(published_file),
        "rows": loaded.counts,
        "skipped_domains": {"bank": 2, "weather": 1},
    }
    only_shop = read_toolscale_parquet(published_file, {"shop": domains["shop"]})
    assert list(only_shop.tasks) == ["shop"] and len(only_shop.tasks["shop"]) == 3
    assert only_shop.skipped == {"bank": 2, "clinic": 3, "mobile": 3, "weather": 1}
    assert only_shop.counts == loaded.counts


def test_non_null_arguments_stay_and_a_null_required_one_is_missing(tmp_path, domains):
    """A timestamp, a float and a bool the tool does not take are kept (ISO, typed) for the
    validation filters to name; a required argument given null is missing."""
    extra = dict(BANK_ACTION["arguments"], start_date=datetime.datetime(2026, 3, 4, 10, 30))
    path = write(
        tmp_path / "odd.parquet",
        domains,
        [
            other_row(
                "extra",
                "clinic",
                [
                    {
                        "action_id": "0",
                        "name": "get_patient_details",
                        "arguments": {"patient_id": "PT1", **extra},
                    }
                ],
            ),
            other_row(
                "null",
                "shop",
                [{"action_id": "0", "name": "get_order_details", "arguments": {"order_id": None}}],
            ),
        ],
    )
    extra_task, null_task = [
        task for tasks in read_toolscale_parquet(path, domains).tasks.values() for task in tasks
    ]
    assert extra_task.gold_actions[0].arguments == {
        "patient_id": "PT1",
        "account_id": "AC1",
        "start_date": "2026-03-04T10:30:00Z",
        "end_date": "2025-01-31T23:59:59Z",
        "min_amount": 20.5,
        "active_only": True,
    }
    refused = rejection(domains["clinic"], extra_task, MAX_ACTIONS)
    assert refused.filter == "schema" and "start_date" in refused.reason
    assert null_task.gold_actions[0].arguments == {}
    refused = rejection(domains["shop"], null_task, MAX_ACTIONS)
    assert refused.filter == "schema" and "order_id" in refused.reason


def test_a_null_stays_where_the_tool_accepts_null(tmp_path, domains, monkeypatch):
    path = write(
        tmp_path / "nullable.parquet",
        domains,
        [
            other_row(
                "n",
                "shop",
                [{"action_id": "0", "name": "get_order_details", "arguments": {"order_id": "#O1"}}],
            )
        ],
    )
    shop = domains["shop"]
    # no offline tool takes a null: a tool whose schema accepts one, in both JSON-schema forms
    nullable = {
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "email": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "zip": {"type": ["string", "null"]},
        },
    }
    monkeypatch.setattr(shop.spec, "parameters", lambda tool: nullable)
    task = read_toolscale_parquet(path, {"shop": shop}).tasks["shop"][0]
    assert task.gold_actions[0].arguments == {"order_id": "#O1", "email": None, "zip": None}


def test_bad_rows_name_the_file_and_row(tmp_path, domains, originals):
    good = row(originals["shop"][0])
    path = write(
        tmp_path / "bad.parquet",
        domains,
        [good, other_row("b", "bank", []), other_row("x", "shop", [], reason=None)],
    )
    with pytest.raises(
        DataError,
        match=r"bad\.parquet\[row 2\]: user_scenario\.instructions"
        r".*reason_for_call",
    ):
        read_toolscale_parquet(path, domains)
    path = write(tmp_path / "nodomain.parquet", domains, [good, other_row("y", None, [])])
    with pytest.raises(
        DataError,
        match=r"nodomain\.parquet\[row 1\]: user_scenario\."
        r"instructions\.domain must name",
    ):
        read_toolscale_parquet(path, domains)
    path = write(tmp_path / "twice.parquet", domains, [good, good])
    with pytest.raises(DataError, match=r"twice\.parquet\[row 1\]: duplicate task id"):
        read_toolscale_parquet(path, domains)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot read the parquet file"):
        read_toolscale_parquet(broken, domains)


def test_the_toolscale_environment_trains_on_the_installed_domains_of_the_file(
    published_file, offline
):
    from nemo_orch import config as config_lib
    from nemo_orch.config import ConfigError
    from nemo_orch.envs import build_environment

    shop = offline / "shop" / "domain.json"
    env = build_environment(
        config_lib.load(["env=toolscale", f"env.path={published_file}", f"tools.domains=[{shop}]"])
    )
    assert env.notes["tasks_by_domain"] == {"shop": 3}
    assert env.notes["rows_by_domain"] == {
        "bank": 2,
        "clinic": 3,
        "mobile": 3,
        "shop": 3,
        "weather": 1,
    }
    assert env.notes["domains_not_installed"] == {"bank": 2, "clinic": 3, "mobile": 3, "weather": 1}
    assert [task.id.split("/")[0] for task in env.tasks("test", None, 0)] == ["shop"] * 3
    with pytest.raises(ConfigError, match="no valid task of an installed domain"):
        build_environment(config_lib.load(["env=toolscale", f"env.path={published_file}"]))


# A tool taking a map of structs and a list of structs, and a field that is a struct here and a
# string in another domain's tool of the same argument name.
NESTED = {
    "type": "object",
    "properties": {
        "choices": {"type": "object", "additionalProperties": {"$ref": "#/$defs/Choice"}},
        "people": {
            "type": "array",
            "items": {"anyOf": [{"$ref": "#/$defs/Person"}, {"type": "null"}]},
        },
        "details": {
            "type": "object",
            "properties": {"plan": {"type": "string"}, "count": {"type": "integer"}},
        },
    },
    "$defs": {
        "Choice": {
            "type": "object",
            "properties": {"option": {"type": "string"}, "note": {"type": ["string", "null"]}},
        },
        "Person": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        },
    },
}
AS_TEXT = {"type": "object", "properties": {"details": {"type": "string"}}}


def nested_rows() -> list[dict[str, Any]]:
    """Two domains' rows as tau2's JSON: the tools' arguments of different shapes, which the
    published conversion merges into one struct."""
    return [
        other_row(
            "a",
            "school",
            [
                {
                    "action_id": "0",
                    "name": "enroll",
                    "arguments": {
                        "choices": {"CS101": {"option": "audit", "note": None}},
                        "people": [{"name": "Ann", "age": 30}],
                        "details": json.dumps({"plan": "full", "count": 2}),
                    },
                }
            ],
        ),
        other_row(
            "b",
            "school",
            [
                {
                    "action_id": "0",
                    "name": "enroll",
                    "arguments": {
                        "choices": {"MA201": {"option": "credit"}},
                        "people": [{"name": "Bo"}, {"age": 41}],
                    },
                }
            ],
        ),
        other_row(
            "c",
            "insurance",
            [{"action_id": "0", "name": "file_claim", "arguments": {"details": "water damage"}}],
        ),
    ]


def published_by_conversion(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows written as JSON lines and converted as the Hub's JSON-to-parquet conversion does
    (pyarrow's JSON reader: the union struct of every key, dates and zoned times typed as
    timestamps)."""
    import pyarrow.json as pa_json

    lines = tmp_path / "rows.jsonl"
    lines.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa_json.read_json(lines), path)
    return path


def test_nulls_the_union_struct_added_are_dropped_at_every_depth(tmp_path):
    """A map of structs and a list of structs hold every key any row used; read back, each holds
    its own (a null stays where the schema takes one); a struct published as JSON text is an
    object again where the tool expects one, and stays text where the other domain's tool
    takes a string."""
    from nemo_orch.data.records import read_records
    from nemo_orch.envs.toolscale.parquet import published_record

    path = published_by_conversion(tmp_path, nested_rows())
    merged = pq.read_table(path).to_pylist()[1]["evaluation_criteria"]["actions"][0]["arguments"]
    assert merged["choices"] == {"CS101": None, "MA201": {"option": "credit"}}
    assert merged["people"] == [{"name": "Bo", "age": None}, {"name": None, "age": 41}]
    arguments = [
        published_record(row, {"enroll": NESTED, "file_claim": AS_TEXT})["evaluation_criteria"][
            "actions"
        ][0]["arguments"]
        for _, row in read_records(path)
    ]
    assert arguments == [
        {
            "choices": {"CS101": {"option": "audit", "note": None}},
            "people": [{"name": "Ann", "age": 30}],
            "details": {"plan": "full", "count": 2},
        },
        {"choices": {"MA201": {"option": "credit"}}, "people": [{"name": "Bo"}, {"age": 41}]},
        {"details": "water damage"},
    ]


def test_timestamps_round_trip_with_their_zone(tmp_path):
    """pyarrow's JSON reader types a date and a zoned time as naive timestamps (the zone made
    UTC); a column written zoned keeps its zone."""
    from nemo_orch.data.records import read_records
    from nemo_orch.envs.toolscale.parquet import published_record

    path = published_by_conversion(
        tmp_path,
        [
            other_row(
                "t",
                "bank",
                [
                    {
                        "action_id": "0",
                        "name": "list_transactions",
                        "arguments": {
                            "start_date": "2026-03-04",
                            "end_date": "2026-03-04T10:30:00Z",
                            "posted_at": "2026-03-04T12:30:00+02:00",
                        },
                    }
                ],
            )
        ],
    )
    arguments = published_record(read_records(path)[0][1], {})["evaluation_criteria"]["actions"][0][
        "arguments"
    ]
    assert arguments == {
        "start_date": "2026-03-04",
        "end_date": "2026-03-04T10:30:00Z",
        "posted_at": "2026-03-04T10:30:00Z",
    }
    zoned = tmp_path / "zoned.parquet"
    stamp = pa.array([datetime.datetime(2026, 3, 4, 10, 30)], pa.timestamp("s", tz="UTC"))
    berlin = pa.array(
        [datetime.datetime(2026, 3, 4, 10, 30)], pa.timestamp("s", tz="Europe/Berlin")
    )
    pq.write_table(pa.table({"utc": stamp, "berlin": berlin}), zoned)
    ((_, row),) = read_records(zoned)
    assert published_record(row, {}) == {
        "utc": "2026-03-04T10:30:00Z",
        "berlin": "2026-03-04T11:30:00+01:00",
    }
