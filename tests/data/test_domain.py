"""Domain declarations, typed tools, atomic writes and state hashing."""

from __future__ import annotations

import copy

import pytest

from nemo_orch.data.domain import ActionError, Domain, DomainSpec, state_hash
from nemo_orch.data.jsonl import DataError
from nemo_orch.envs.toolscale.domain_records import generate_domain
from nemo_orch.envs.toolscale.domain_specs import DOMAINS


@pytest.fixture(scope="module")
def shop() -> Domain:
    return generate_domain("shop", seed=0)


def test_offline_domains_have_ten_plus_read_and_write_tools():
    for name in DOMAINS:
        tools = generate_domain(name, seed=0).spec.tools.values()
        assert len(tools) >= 10
        assert any(tool.writes for tool in tools) and any(not tool.writes for tool in tools)


def test_state_hash_is_canonical(shop):
    reordered = {
        table: dict(reversed(list(records.items())))
        for table, records in reversed(list(shop.database.items()))
    }
    assert state_hash(reordered) == state_hash(shop.database)
    changed = shop.fresh_database()
    changed["customers"]["C1"]["zip"] = "00000"
    assert state_hash(changed) != state_hash(shop.database)


def test_tool_parameters_are_typed_json_schema(shop):
    parameters = shop.spec.parameters("add_store_credit")
    assert parameters["required"] == ["customer_id", "amount"]
    assert parameters["properties"]["amount"] == {"type": "number"}
    assert shop.spec.parameters("find_customer_id_by_name_zip")["additionalProperties"] is False
    clinic = generate_domain("clinic", seed=0)
    insurance = clinic.spec.parameters("update_patient_insurance")["properties"]["insurance"]
    assert insurance["enum"] == ["none", "basic", "premium"]


def test_reads_and_writes(shop):
    database = shop.fresh_database()
    order = next(o for o in database["orders"].values() if o["status"] == "pending")
    assert (
        shop.spec.execute(database, "get_order_details", {"order_id": order["order_id"]}) == order
    )
    cancelled = shop.spec.execute(database, "cancel_pending_order", {"order_id": order["order_id"]})
    assert cancelled["status"] == database["orders"][order["order_id"]]["status"] == "cancelled"
    customer = database["customers"]["C1"]
    assert (
        shop.spec.execute(
            database,
            "find_customer_id_by_name_zip",
            {
                "first_name": customer["first_name"],
                "last_name": customer["last_name"],
                "zip": customer["zip"],
            },
        )[0]
        == "C1"
    )
    created = shop.spec.execute(
        database,
        "place_order",
        {
            "customer_id": "C1",
            "product_id": "P1",
            "quantity": 2,
            "address": "1 Oak St",
            "total": 10,
        },
    )
    assert created["order_id"] == f"#O{len(shop.database['orders']) + 1}"
    assert created["status"] == "pending" and created["total"] == 10.0


@pytest.mark.parametrize(
    "name, arguments, message",
    [
        ("cancel_pending_order", {"order_id": 7}, "order_id"),
        ("cancel_pending_order", {}, "order_id"),
        ("cancel_pending_order", {"order_id": "#O1", "reason": "x"}, "reason"),
        ("cancel_pending_order", {"order_id": "#O999"}, "no orders record"),
        ("add_store_credit", {"customer_id": "C1", "amount": -10_000}, "below"),
        ("add_store_credit", {"customer_id": "C1", "amount": "5"}, "amount"),
        ("no_such_tool", {}, "unknown tool"),
    ],
)
def test_refused_calls_leave_the_state_untouched(shop, name, arguments, message):
    database = shop.fresh_database()
    before = state_hash(database)
    with pytest.raises(ActionError, match=message):
        shop.spec.execute(database, name, arguments)
    assert state_hash(database) == before


def test_preconditions_guard_writes(shop):
    database = shop.fresh_database()
    delivered = next(o for o in database["orders"].values() if o["status"] == "delivered")
    with pytest.raises(ActionError, match="needs 'pending'"):
        shop.spec.execute(database, "cancel_pending_order", {"order_id": delivered["order_id"]})


def test_round_trip_and_bad_declarations(shop, tmp_path):
    path = tmp_path / "shop.json"
    shop.save(path)
    loaded = Domain.load(path)
    assert loaded.spec.to_json() == shop.spec.to_json()
    assert state_hash(loaded.database) == state_hash(shop.database)
    raw = shop.spec.to_json()
    broken = copy.deepcopy(raw)
    broken["tools"][0]["table"] = "nope"
    with pytest.raises(DataError, match="unknown table 'nope'"):
        DomainSpec.from_json(broken)
    broken = copy.deepcopy(raw)
    broken["tools"][8]["require"] = {"colour": "red"}
    with pytest.raises(DataError, match="colour"):
        DomainSpec.from_json(broken)
    bad_record = shop.to_json()
    bad_record["database"]["customers"]["C1"]["tier"] = "platinum"
    with pytest.raises(DataError, match=r"customers\['C1'\].tier"):
        Domain.from_json(bad_record)
    path.write_text('{"domain": {\n  "name": ')
    with pytest.raises(DataError, match=rf"{path.name}:2"):
        Domain.load(path)
