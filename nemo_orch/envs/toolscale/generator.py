"""The offline ToolScale task generator: seeded tasks over the offline domains, with no LLM.

A task is a customer who first has to be identified (by name and zip, phone or email, unless they
know their id) and then has one to four goals (cancel an order, book a specialist, pay a bill, ...),
each one to three gold actions; a goal may instead ask for a fact, which the agent must
communicate. Goals are drawn against a working copy of the database, so a later goal sees what an
earlier one changed, and the task's difficulty is its number of gold actions (1 to 10). Every task
passes the validation filters (:mod:`.validate`) before it is yielded. Same seed, same domains,
same tasks. The domains themselves are declared in :mod:`.domain_specs` and filled with seeded
records in :mod:`.domain_records`.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_orch.data.domain import Database, Domain, state_hash
from nemo_orch.data.domain_tasks import DomainTask, write_domain_tasks
from nemo_orch.envs.toolscale.domain_records import (
    generate_domain,
    random_address,
    random_date,
    random_digits,
)
from nemo_orch.envs.toolscale.domain_specs import DOMAINS, SPECS
from nemo_orch.envs.toolscale.validate import ValidationSummary, validated

MAX_ACTIONS = 12


# ---------------------------------------------------------------------- tasks
@dataclass
class _Draft:
    """A task being drawn: its gold calls (run on ``database`` as they are added), what the
    user asks for and the facts the agent must tell."""

    domain: Domain
    database: Database
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)

    def call(self, tool: str, **arguments: Any) -> Any:
        self.calls.append((tool, arguments))
        return self.domain.spec.execute(self.database, tool, arguments)

    def records(self, table: str, **match: Any) -> list[dict[str, Any]]:
        return [
            record
            for record in self.database[table].values()
            if all(record[key] == value for key, value in match.items())
        ]


# A goal draws one request for the identified user, or returns False when none fits.
Goal = Callable[[_Draft, random.Random, str], bool]


def _fact(value: float) -> str:
    return f"{value:g}"


def _check_then_write(
    table: str,
    owner: str,
    read: str,
    write: str,
    request: str,
    extra: Callable[[random.Random], dict[str, Any]] | None = None,
    **match: Any,
) -> Goal:
    """The commonest goal: pick one of the user's ``table`` records (``owner`` is the user,
    ``match`` the rest of the condition), read it with ``read``, then call ``write`` on it with
    the ``extra`` arguments; the user's ``request`` is formatted with ``key`` and them."""

    def goal(draft: _Draft, rng: random.Random, user: str) -> bool:
        records = draft.records(table, **{owner: user}, **match)
        if not records:
            return False
        key_field = draft.domain.spec.tables[table].key
        key = rng.choice(records)[key_field]
        arguments = extra(rng) if extra is not None else {}
        draft.call(read, **{key_field: key})
        draft.call(write, **{key_field: key}, **arguments)
        draft.requests.append(request.format(key=key, **arguments))
        return True

    return goal


def _shop_goals() -> list[Goal]:
    def move(draft: _Draft, rng: random.Random, user: str) -> bool:
        address = random_address(rng)
        draft.call("update_customer_address", customer_id=user, address=address)
        draft.requests.append(f"change your default address to {address}")
        return True

    def buy(draft: _Draft, rng: random.Random, user: str) -> bool:
        product = rng.choice(list(draft.database["products"].values()))
        quantity = rng.randint(1, 3)
        product_id = draft.call("find_product_id_by_name", name=product["name"])[0]
        price = draft.call("get_product_details", product_id=product_id)["price"]
        address = draft.database["customers"][user]["address"]
        draft.call(
            "place_order",
            customer_id=user,
            product_id=product_id,
            quantity=quantity,
            address=address,
            total=price * quantity,
        )
        draft.requests.append(
            f"order {quantity} x {product['name']} to your default address and hear the total"
        )
        draft.facts.append(_fact(price * quantity))
        return True

    def credit(draft: _Draft, rng: random.Random, user: str) -> bool:
        amount = draft.call("get_customer_details", customer_id=user)["store_credit"]
        draft.requests.append("learn how much store credit you have")
        draft.facts.append(_fact(amount))
        return True

    return [
        _check_then_write(
            "orders",
            "customer_id",
            "get_order_details",
            "cancel_pending_order",
            "cancel order {key}",
            status="pending",
        ),
        _check_then_write(
            "orders",
            "customer_id",
            "get_order_details",
            "change_order_address",
            "have order {key} sent to {address}",
            lambda rng: {"address": random_address(rng)},
            status="pending",
        ),
        _check_then_write(
            "orders",
            "customer_id",
            "get_order_details",
            "request_return",
            "return order {key}",
            status="delivered",
        ),
        move,
        buy,
        credit,
    ]


def _clinic_goals() -> list[Goal]:
    specialties = SPECS["clinic"]["tables"]["doctors"]["fields"]["specialty"]["enum"]

    def book(draft: _Draft, rng: random.Random, user: str) -> bool:
        specialty, date, time = (
            rng.choice(specialties),
            random_date(rng),
            f"{rng.randint(8, 17):02d}:30",
        )
        doctor = draft.call("find_doctors_by_specialty", specialty=specialty)[0]
        fee = draft.call("get_doctor_details", doctor_id=doctor)["fee"]
        draft.call("book_appointment", patient_id=user, doctor_id=doctor, date=date, time=time)
        draft.requests.append(
            f"book the first {specialty} doctor on {date} at {time} and hear the fee"
        )
        draft.facts.append(_fact(fee))
        return True

    def phone(draft: _Draft, rng: random.Random, user: str) -> bool:
        number = f"555-{random_digits(rng, 4)}"
        draft.call("update_patient_phone", patient_id=user, phone=number)
        draft.requests.append(f"change your phone number to {number}")
        return True

    def insurance(draft: _Draft, rng: random.Random, user: str) -> bool:
        current = draft.call("get_patient_details", patient_id=user)["insurance"]
        plan = rng.choice([p for p in ("none", "basic", "premium") if p != current])
        draft.call("update_patient_insurance", patient_id=user, insurance=plan)
        draft.requests.append(f"switch your insurance to {plan}")
        return True

    def count(draft: _Draft, rng: random.Random, user: str) -> bool:
        appointments = draft.call("list_patient_appointments", patient_id=user)
        scheduled = sum(a["status"] == "scheduled" for a in appointments)
        draft.requests.append("learn how many appointments you have scheduled")
        draft.facts.append(str(scheduled))
        return True

    return [
        book,
        _check_then_write(
            "appointments",
            "patient_id",
            "get_appointment_details",
            "cancel_appointment",
            "cancel appointment {key}",
            status="scheduled",
        ),
        _check_then_write(
            "appointments",
            "patient_id",
            "get_appointment_details",
            "reschedule_appointment",
            "move appointment {key} to {date} at {time}",
            lambda rng: {"date": random_date(rng), "time": "09:00"},
            status="scheduled",
        ),
        phone,
        insurance,
        count,
    ]


def _mobile_goals() -> list[Goal]:
    def replan(draft: _Draft, rng: random.Random, user: str) -> bool:
        lines = draft.records("lines", subscriber_id=user, status="active")
        plans = list(draft.database["plans"].values())
        if not lines:
            return False
        line = rng.choice(lines)
        plan = rng.choice([p for p in plans if p["plan_id"] != line["plan_id"]])
        plan_id = draft.call("find_plan_id_by_name", name=plan["name"])[0]
        fee = draft.call("get_plan_details", plan_id=plan_id)["monthly_fee"]
        draft.call("change_line_plan", line_id=line["line_id"], plan_id=plan_id)
        draft.requests.append(
            f"move line {line['line_id']} to the {plan['name']} plan and hear its monthly fee"
        )
        draft.facts.append(_fact(fee))
        return True

    def pay(draft: _Draft, rng: random.Random, user: str) -> bool:
        unpaid = draft.records("bills", subscriber_id=user, status="unpaid")
        if not unpaid:
            return False
        bill = rng.choice(unpaid)
        draft.call("list_subscriber_bills", subscriber_id=user)
        draft.call("pay_bill", bill_id=bill["bill_id"])
        draft.requests.append(f"pay your {bill['month']} bill and hear the amount")
        draft.facts.append(_fact(bill["amount"]))
        return True

    def balance(draft: _Draft, rng: random.Random, user: str) -> bool:
        amount = draft.call("get_subscriber_details", subscriber_id=user)["balance"]
        draft.requests.append("learn your account balance")
        draft.facts.append(_fact(amount))
        return True

    return [
        replan,
        _check_then_write(
            "lines",
            "subscriber_id",
            "get_line_details",
            "suspend_line",
            "suspend line {key}",
            status="active",
        ),
        _check_then_write(
            "lines",
            "subscriber_id",
            "get_line_details",
            "resume_line",
            "resume line {key}",
            status="suspended",
        ),
        pay,
        _check_then_write(
            "lines",
            "subscriber_id",
            "get_line_details",
            "add_data",
            "add {amount:g} GB of data to line {key}",
            lambda rng: {"amount": float(rng.choice((1, 2, 5)))},
        ),
        balance,
    ]


_GOALS: dict[str, Callable[[], list[Goal]]] = {
    "shop": _shop_goals,
    "clinic": _clinic_goals,
    "mobile": _mobile_goals,
}


def _identify(draft: _Draft, rng: random.Random) -> tuple[str, str, str]:
    """Pick the user and the way they are identified: ``(user id, known info, unknown info)``,
    with the lookup call added unless the user knows their id."""
    name = draft.domain.name
    table, key = {
        "shop": ("customers", "customer_id"),
        "clinic": ("patients", "patient_id"),
        "mobile": ("subscribers", "subscriber_id"),
    }[name]
    user = rng.choice(list(draft.database[table].values()))
    way = rng.choice(("id", "lookup", "lookup"))
    if way == "id":
        return user[key], f"Your {key.replace('_', ' ')} is {user[key]}.", ""
    unknown = f"You do not remember your {key.replace('_', ' ')}."
    if name == "shop":
        found = draft.call(
            "find_customer_id_by_name_zip",
            first_name=user["first_name"],
            last_name=user["last_name"],
            zip=user["zip"],
        )
        known = f"You are {user['first_name']} {user['last_name']}, zip code {user['zip']}."
    elif name == "clinic":
        found = draft.call(
            "find_patient_id_by_name_birth_date",
            first_name=user["first_name"],
            last_name=user["last_name"],
            birth_date=user["birth_date"],
        )
        known = f"You are {user['first_name']} {user['last_name']}, born {user['birth_date']}."
    else:
        found = draft.call("find_subscriber_id_by_phone", phone=user["phone"])
        known = f"You are {user['name']}; your phone is {user['phone']}."
    if found != [user[key]]:  # the name is not unique: the user gives their id instead
        draft.calls.pop()
        return user[key], f"Your {key.replace('_', ' ')} is {user[key]}.", ""
    return user[key], known, unknown


def _draw_task(domain: Domain, goals: list[Goal], rng: random.Random, index: int) -> DomainTask:
    draft = _Draft(domain, domain.fresh_database())
    user, known, unknown = _identify(draft, rng)
    wanted = rng.choice((1, 1, 2, 2, 3, 4))
    for goal in rng.sample(goals, len(goals)):
        if len(draft.requests) == wanted:
            break
        goal(draft, rng, user)
    actions = [
        {"action_id": f"{index}_{n}", "name": name, "arguments": arguments}
        for n, (name, arguments) in enumerate(draft.calls)
    ]
    reason = "You want to " + "; then ".join(draft.requests) + "."
    return DomainTask.model_validate(
        {
            "id": f"{domain.name}-{index:06d}",
            "description": {
                "purpose": f"{len(draft.requests)} request(s), {len(actions)} gold actions"
            },
            "user_scenario": {
                "instructions": {
                    "domain": domain.name,
                    "reason_for_call": reason,
                    "known_info": known,
                    "unknown_info": unknown or None,
                    "task_instructions": "Ask for everything in one conversation.",
                }
            },
            "evaluation_criteria": {"actions": actions, "communicate_info": draft.facts},
        }
    )


def generate_tasks(
    domain: Domain, seed: int, summary: ValidationSummary | None = None
) -> Iterator[DomainTask]:
    """An endless, seeded stream of valid tasks for ``domain`` (take as many as needed)."""
    rng = random.Random(f"{seed}:{domain.name}:{state_hash(domain.database)}")
    goals = _GOALS[domain.name]()
    summary = summary if summary is not None else ValidationSummary()

    def drafts() -> Iterator[DomainTask]:
        index = 0
        while True:
            yield _draw_task(domain, goals, rng, index)
            index += 1

    return validated(domain, drafts(), MAX_ACTIONS, summary)


def write_offline(out: str | Path, tasks_per_domain: int, seed: int) -> dict[str, Any]:
    """Every offline domain and ``tasks_per_domain`` of its tasks, streamed to
    ``out/<domain>/{domain.json,tasks.jsonl}``, and ``out/summary.json``; returns the summary."""
    out = Path(out)
    domains = []
    for name in DOMAINS:
        domain, summary = generate_domain(name, seed), ValidationSummary()
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        domain.save(directory / "domain.json")
        count = write_domain_tasks(
            directory / "tasks.jsonl",
            itertools.islice(generate_tasks(domain, seed, summary), tasks_per_domain),
        )
        domains.append(
            {
                "name": name,
                "domain_file": str(directory / "domain.json"),
                "tasks_file": str(directory / "tasks.jsonl"),
                "tasks": count,
                "tools": len(domain.spec.tools),
                "validation": summary.to_json(),
            }
        )
    summary_json = {"out_dir": str(out), "seed": seed, "domains": domains}
    (out / "summary.json").write_text(json.dumps(summary_json, indent=1))
    return summary_json
