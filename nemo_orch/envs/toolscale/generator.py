"""The offline ToolScale generator: three domains and their tasks, seeded, with no LLM.

Domains (``shop``, ``clinic``, ``mobile``) are declared as :class:`~nemo_orch.data.domain.DomainSpec`
data with 12-15 read and write tools each, and filled with seeded records. A task is a customer
who first has to be identified (by name and zip, phone or email, unless they know their id) and
then has one to four goals (cancel an order, book a specialist, pay a bill, ...), each one to three
gold actions; a goal may instead ask for a fact, which the agent must communicate. Goals are drawn
against a working copy of the database, so a later goal sees what an earlier one changed, and the
task's difficulty is its number of gold actions (1 to 10). Every task passes the validation
filters (:mod:`.validate`) before it is yielded. Same seed, same domains, same tasks.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_orch.data.domain import Database, Domain, DomainSpec, state_hash
from nemo_orch.data.domain_tasks import DomainTask, write_domain_tasks
from nemo_orch.envs.toolscale.validate import ValidationSummary, validated

DOMAINS = ("shop", "clinic", "mobile")
MAX_ACTIONS = 12

_FIRST = (
    "Ana",
    "Ben",
    "Chloe",
    "Dev",
    "Elif",
    "Farid",
    "Grace",
    "Hugo",
    "Ines",
    "Jun",
    "Kofi",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
)
_LAST = (
    "Diaz",
    "Okafor",
    "Nguyen",
    "Schmidt",
    "Rossi",
    "Haddad",
    "Kim",
    "Silva",
    "Novak",
    "Iyer",
    "Moreau",
    "Sato",
    "Larsen",
    "Mensah",
    "Ortiz",
    "Petrov",
)
_STREETS = (
    "Oak St",
    "Pine Ave",
    "Maple Rd",
    "Cedar Ln",
    "Elm St",
    "Birch Way",
    "Lake Dr",
    "Hill Rd",
)


def _field(kind: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, **extra}


_SPECS: dict[str, dict[str, Any]] = {
    "shop": {
        "name": "shop",
        "policy": (
            "You are a customer-service agent of an online shop. Identify the customer "
            "(name and zip, or email) before acting on their account. Only pending "
            "orders can be cancelled or redirected; only delivered orders can be "
            "returned. Tell the customer every figure they ask for."
        ),
        "tables": {
            "customers": {
                "key": "customer_id",
                "id_prefix": "C",
                "fields": {
                    "customer_id": "string",
                    "first_name": "string",
                    "last_name": "string",
                    "zip": "string",
                    "email": "string",
                    "address": "string",
                    "store_credit": "number",
                    "tier": _field("string", enum=["basic", "gold"]),
                },
            },
            "products": {
                "key": "product_id",
                "id_prefix": "P",
                "fields": {
                    "product_id": "string",
                    "name": "string",
                    "price": "number",
                    "stock": "integer",
                },
            },
            "orders": {
                "key": "order_id",
                "id_prefix": "#O",
                "fields": {
                    "order_id": "string",
                    "customer_id": _field("string", ref="customers"),
                    "product_id": _field("string", ref="products"),
                    "quantity": "integer",
                    "status": _field(
                        "string",
                        enum=["pending", "shipped", "delivered", "cancelled", "return_requested"],
                    ),
                    "address": "string",
                    "total": "number",
                },
            },
        },
        "tools": [
            {
                "name": "find_customer_id_by_name_zip",
                "op": "find",
                "table": "customers",
                "match": ["first_name", "last_name", "zip"],
                "description": "Find a customer's id from their first name, last name and zip.",
            },
            {
                "name": "find_customer_id_by_email",
                "op": "find",
                "table": "customers",
                "match": ["email"],
                "description": "Find a customer's id from their email.",
            },
            {
                "name": "get_customer_details",
                "op": "get",
                "table": "customers",
                "description": "A customer's profile: address, store credit and tier.",
            },
            {
                "name": "list_customer_orders",
                "op": "list",
                "table": "orders",
                "match": ["customer_id"],
                "description": "Every order of a customer.",
            },
            {
                "name": "get_order_details",
                "op": "get",
                "table": "orders",
                "description": "An order: product, quantity, status, address and total.",
            },
            {
                "name": "find_product_id_by_name",
                "op": "find",
                "table": "products",
                "match": ["name"],
                "description": "Find a product's id from its name.",
            },
            {
                "name": "get_product_details",
                "op": "get",
                "table": "products",
                "description": "A product's name, price and stock.",
            },
            {
                "name": "place_order",
                "op": "create",
                "table": "orders",
                "args": ["customer_id", "product_id", "quantity", "address", "total"],
                "set": {"status": "pending"},
                "description": "Place an order; total is price times quantity.",
            },
            {
                "name": "cancel_pending_order",
                "op": "update",
                "table": "orders",
                "set": {"status": "cancelled"},
                "require": {"status": "pending"},
                "description": "Cancel an order that has not shipped yet.",
            },
            {
                "name": "change_order_address",
                "op": "update",
                "table": "orders",
                "args": ["address"],
                "require": {"status": "pending"},
                "description": "Send a pending order to another address.",
            },
            {
                "name": "request_return",
                "op": "update",
                "table": "orders",
                "set": {"status": "return_requested"},
                "require": {"status": "delivered"},
                "description": "Start the return of a delivered order.",
            },
            {
                "name": "update_customer_address",
                "op": "update",
                "table": "customers",
                "args": ["address"],
                "description": "Change a customer's default address.",
            },
            {
                "name": "add_store_credit",
                "op": "increment",
                "table": "customers",
                "field": "store_credit",
                "minimum": 0,
                "description": "Add (or, negative, take) store credit in dollars.",
            },
        ],
    },
    "clinic": {
        "name": "clinic",
        "policy": (
            "You are the front desk of a clinic. Identify the patient (name and birth "
            "date, or phone) first. Only scheduled appointments can be cancelled or "
            "moved. Book with a doctor of the specialty the patient asks for."
        ),
        "tables": {
            "patients": {
                "key": "patient_id",
                "id_prefix": "PT",
                "fields": {
                    "patient_id": "string",
                    "first_name": "string",
                    "last_name": "string",
                    "birth_date": "string",
                    "phone": "string",
                    "insurance": _field("string", enum=["none", "basic", "premium"]),
                },
            },
            "doctors": {
                "key": "doctor_id",
                "id_prefix": "D",
                "fields": {
                    "doctor_id": "string",
                    "name": "string",
                    "specialty": _field(
                        "string",
                        enum=[
                            "cardiology",
                            "dermatology",
                            "pediatrics",
                            "orthopedics",
                            "neurology",
                        ],
                    ),
                    "fee": "number",
                },
            },
            "appointments": {
                "key": "appointment_id",
                "id_prefix": "A",
                "fields": {
                    "appointment_id": "string",
                    "patient_id": _field("string", ref="patients"),
                    "doctor_id": _field("string", ref="doctors"),
                    "date": "string",
                    "time": "string",
                    "status": _field("string", enum=["scheduled", "cancelled", "completed"]),
                },
            },
        },
        "tools": [
            {
                "name": "find_patient_id_by_name_birth_date",
                "op": "find",
                "table": "patients",
                "match": ["first_name", "last_name", "birth_date"],
                "description": "Find a patient's id from name and birth date (YYYY-MM-DD).",
            },
            {
                "name": "find_patient_id_by_phone",
                "op": "find",
                "table": "patients",
                "match": ["phone"],
                "description": "Find a patient's id from their phone.",
            },
            {
                "name": "get_patient_details",
                "op": "get",
                "table": "patients",
                "description": "A patient's contact details and insurance.",
            },
            {
                "name": "find_doctors_by_specialty",
                "op": "find",
                "table": "doctors",
                "match": ["specialty"],
                "description": "The ids of the doctors of a specialty.",
            },
            {
                "name": "get_doctor_details",
                "op": "get",
                "table": "doctors",
                "description": "A doctor's name, specialty and fee.",
            },
            {
                "name": "list_patient_appointments",
                "op": "list",
                "table": "appointments",
                "match": ["patient_id"],
                "description": "Every appointment of a patient.",
            },
            {
                "name": "get_appointment_details",
                "op": "get",
                "table": "appointments",
                "description": "An appointment's doctor, date, time and status.",
            },
            {
                "name": "book_appointment",
                "op": "create",
                "table": "appointments",
                "args": ["patient_id", "doctor_id", "date", "time"],
                "set": {"status": "scheduled"},
                "description": "Book an appointment.",
            },
            {
                "name": "cancel_appointment",
                "op": "update",
                "table": "appointments",
                "set": {"status": "cancelled"},
                "require": {"status": "scheduled"},
                "description": "Cancel a scheduled appointment.",
            },
            {
                "name": "reschedule_appointment",
                "op": "update",
                "table": "appointments",
                "args": ["date", "time"],
                "require": {"status": "scheduled"},
                "description": "Move a scheduled appointment to another date and time.",
            },
            {
                "name": "update_patient_phone",
                "op": "update",
                "table": "patients",
                "args": ["phone"],
                "description": "Change a patient's phone number.",
            },
            {
                "name": "update_patient_insurance",
                "op": "update",
                "table": "patients",
                "args": ["insurance"],
                "description": "Change a patient's insurance plan.",
            },
        ],
    },
    "mobile": {
        "name": "mobile",
        "policy": (
            "You are a mobile carrier's support agent. Identify the subscriber (phone "
            "or email) first. Only active lines can change plan or be suspended; only "
            "suspended lines can be resumed; only unpaid bills can be paid."
        ),
        "tables": {
            "subscribers": {
                "key": "subscriber_id",
                "id_prefix": "S",
                "fields": {
                    "subscriber_id": "string",
                    "name": "string",
                    "phone": "string",
                    "email": "string",
                    "balance": "number",
                },
            },
            "plans": {
                "key": "plan_id",
                "id_prefix": "PL",
                "fields": {
                    "plan_id": "string",
                    "name": "string",
                    "monthly_fee": "number",
                    "data_gb": "integer",
                },
            },
            "lines": {
                "key": "line_id",
                "id_prefix": "L",
                "fields": {
                    "line_id": "string",
                    "subscriber_id": _field("string", ref="subscribers"),
                    "number": "string",
                    "plan_id": _field("string", ref="plans"),
                    "status": _field("string", enum=["active", "suspended"]),
                    "data_left_gb": "number",
                },
            },
            "bills": {
                "key": "bill_id",
                "id_prefix": "B",
                "fields": {
                    "bill_id": "string",
                    "subscriber_id": _field("string", ref="subscribers"),
                    "month": "string",
                    "amount": "number",
                    "status": _field("string", enum=["unpaid", "paid"]),
                },
            },
        },
        "tools": [
            {
                "name": "find_subscriber_id_by_phone",
                "op": "find",
                "table": "subscribers",
                "match": ["phone"],
                "description": "Find a subscriber's id from their phone.",
            },
            {
                "name": "find_subscriber_id_by_email",
                "op": "find",
                "table": "subscribers",
                "match": ["email"],
                "description": "Find a subscriber's id from their email.",
            },
            {
                "name": "get_subscriber_details",
                "op": "get",
                "table": "subscribers",
                "description": "A subscriber's name, contact details and account balance.",
            },
            {
                "name": "list_subscriber_lines",
                "op": "list",
                "table": "lines",
                "match": ["subscriber_id"],
                "description": "Every line of a subscriber.",
            },
            {
                "name": "get_line_details",
                "op": "get",
                "table": "lines",
                "description": "A line's number, plan, status and data left.",
            },
            {
                "name": "find_plan_id_by_name",
                "op": "find",
                "table": "plans",
                "match": ["name"],
                "description": "Find a plan's id from its name.",
            },
            {
                "name": "get_plan_details",
                "op": "get",
                "table": "plans",
                "description": "A plan's monthly fee and data allowance.",
            },
            {
                "name": "list_subscriber_bills",
                "op": "list",
                "table": "bills",
                "match": ["subscriber_id"],
                "description": "Every bill of a subscriber.",
            },
            {
                "name": "get_bill_details",
                "op": "get",
                "table": "bills",
                "description": "A bill's month, amount and status.",
            },
            {
                "name": "change_line_plan",
                "op": "update",
                "table": "lines",
                "args": ["plan_id"],
                "require": {"status": "active"},
                "description": "Move an active line to another plan.",
            },
            {
                "name": "suspend_line",
                "op": "update",
                "table": "lines",
                "set": {"status": "suspended"},
                "require": {"status": "active"},
                "description": "Suspend an active line.",
            },
            {
                "name": "resume_line",
                "op": "update",
                "table": "lines",
                "set": {"status": "active"},
                "require": {"status": "suspended"},
                "description": "Resume a suspended line.",
            },
            {
                "name": "pay_bill",
                "op": "update",
                "table": "bills",
                "set": {"status": "paid"},
                "require": {"status": "unpaid"},
                "description": "Mark an unpaid bill as paid.",
            },
            {
                "name": "add_data",
                "op": "increment",
                "table": "lines",
                "field": "data_left_gb",
                "minimum": 0,
                "description": "Add data (GB) to a line.",
            },
            {
                "name": "add_account_credit",
                "op": "increment",
                "table": "subscribers",
                "field": "balance",
                "description": "Add credit (dollars) to the balance.",
            },
        ],
    },
}


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(_FIRST), rng.choice(_LAST)


def _address(rng: random.Random) -> str:
    return f"{rng.randint(1, 999)} {rng.choice(_STREETS)}"


def _digits(rng: random.Random, count: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(count))


def _date(rng: random.Random) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _table(records: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    return {record[key]: record for record in records}


def _shop_records(rng: random.Random) -> Database:
    products = [
        {
            "product_id": f"P{i}",
            "name": name,
            "price": float(rng.randint(5, 400)),
            "stock": rng.randint(0, 50),
        }
        for i, name in enumerate(
            (
                "desk lamp",
                "office chair",
                "kettle",
                "backpack",
                "monitor",
                "keyboard",
                "headphones",
                "blender",
                "umbrella",
                "water bottle",
                "yoga mat",
                "toaster",
            ),
            start=1,
        )
    ]
    customers = []
    for i in range(1, 41):
        first, last = _person(rng)
        customers.append(
            {
                "customer_id": f"C{i}",
                "first_name": first,
                "last_name": last,
                "zip": _digits(rng, 5),
                "email": f"{first}.{last}{i}@mail.test".lower(),
                "address": _address(rng),
                "store_credit": float(rng.randint(0, 60)),
                "tier": rng.choice(["basic", "gold"]),
            }
        )
    orders = []
    for i in range(1, 121):
        customer, product = rng.choice(customers), rng.choice(products)
        quantity = rng.randint(1, 3)
        orders.append(
            {
                "order_id": f"#O{i}",
                "customer_id": customer["customer_id"],
                "product_id": product["product_id"],
                "quantity": quantity,
                "status": rng.choice(["pending", "shipped", "delivered", "delivered", "cancelled"]),
                "address": customer["address"],
                "total": product["price"] * quantity,
            }
        )
    return {
        "customers": _table(customers, "customer_id"),
        "products": _table(products, "product_id"),
        "orders": _table(orders, "order_id"),
    }


def _clinic_records(rng: random.Random) -> Database:
    specialties = _SPECS["clinic"]["tables"]["doctors"]["fields"]["specialty"]["enum"]
    doctors = [
        {
            "doctor_id": f"D{i}",
            "name": f"Dr. {rng.choice(_LAST)}",
            "specialty": specialties[(i - 1) % len(specialties)],
            "fee": float(rng.randint(60, 300)),
        }
        for i in range(1, 11)
    ]
    patients = []
    for i in range(1, 41):
        first, last = _person(rng)
        patients.append(
            {
                "patient_id": f"PT{i}",
                "first_name": first,
                "last_name": last,
                "birth_date": f"19{rng.randint(40, 99)}-{rng.randint(1, 12):02d}-"
                f"{rng.randint(1, 28):02d}",
                "phone": f"555-{_digits(rng, 4)}",
                "insurance": rng.choice(["none", "basic", "premium"]),
            }
        )
    appointments = [
        {
            "appointment_id": f"A{i}",
            "patient_id": rng.choice(patients)["patient_id"],
            "doctor_id": rng.choice(doctors)["doctor_id"],
            "date": _date(rng),
            "time": f"{rng.randint(8, 17):02d}:00",
            "status": rng.choice(["scheduled", "scheduled", "completed", "cancelled"]),
        }
        for i in range(1, 101)
    ]
    return {
        "patients": _table(patients, "patient_id"),
        "doctors": _table(doctors, "doctor_id"),
        "appointments": _table(appointments, "appointment_id"),
    }


def _mobile_records(rng: random.Random) -> Database:
    plans = [
        {"plan_id": f"PL{i}", "name": name, "monthly_fee": fee, "data_gb": data}
        for i, (name, fee, data) in enumerate(
            (
                ("Basic", 15.0, 2),
                ("Plus", 25.0, 10),
                ("Max", 40.0, 50),
                ("Travel", 35.0, 20),
                ("Family", 60.0, 100),
            ),
            start=1,
        )
    ]
    subscribers = []
    for i in range(1, 41):
        first, last = _person(rng)
        subscribers.append(
            {
                "subscriber_id": f"S{i}",
                "name": f"{first} {last}",
                "phone": f"555-{_digits(rng, 4)}",
                "email": f"{first}{i}@carrier.test".lower(),
                "balance": float(rng.randint(0, 50)),
            }
        )
    lines = [
        {
            "line_id": f"L{i}",
            "subscriber_id": subscribers[(i - 1) % 40]["subscriber_id"],
            "number": f"555-{_digits(rng, 4)}",
            "plan_id": rng.choice(plans)["plan_id"],
            "status": rng.choice(["active", "active", "suspended"]),
            "data_left_gb": float(rng.randint(0, 20)),
        }
        for i in range(1, 61)
    ]
    bills = [
        {
            "bill_id": f"B{i}",
            "subscriber_id": rng.choice(subscribers)["subscriber_id"],
            "month": f"2026-{rng.randint(1, 12):02d}",
            "amount": float(rng.randint(10, 120)),
            "status": rng.choice(["unpaid", "paid"]),
        }
        for i in range(1, 121)
    ]
    return {
        "subscribers": _table(subscribers, "subscriber_id"),
        "plans": _table(plans, "plan_id"),
        "lines": _table(lines, "line_id"),
        "bills": _table(bills, "bill_id"),
    }


_RECORDS: dict[str, Callable[[random.Random], Database]] = {
    "shop": _shop_records,
    "clinic": _clinic_records,
    "mobile": _mobile_records,
}


def generate_domain(name: str, seed: int) -> Domain:
    """The domain ``name`` (one of :data:`DOMAINS`) with its records drawn from ``seed``."""
    if name not in _SPECS:
        raise ValueError(f"unknown offline domain {name!r}; one of {DOMAINS}")
    spec = DomainSpec.from_json(_SPECS[name], f"offline domain {name}")
    return Domain(spec, spec.check_database(_RECORDS[name](random.Random(seed))))


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
        address = _address(rng)
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
            lambda rng: {"address": _address(rng)},
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
    specialties = _SPECS["clinic"]["tables"]["doctors"]["fields"]["specialty"]["enum"]

    def book(draft: _Draft, rng: random.Random, user: str) -> bool:
        specialty, date, time = rng.choice(specialties), _date(rng), f"{rng.randint(8, 17):02d}:30"
        doctor = draft.call("find_doctors_by_specialty", specialty=specialty)[0]
        fee = draft.call("get_doctor_details", doctor_id=doctor)["fee"]
        draft.call("book_appointment", patient_id=user, doctor_id=doctor, date=date, time=time)
        draft.requests.append(
            f"book the first {specialty} doctor on {date} at {time} and hear the fee"
        )
        draft.facts.append(_fact(fee))
        return True

    def phone(draft: _Draft, rng: random.Random, user: str) -> bool:
        number = f"555-{_digits(rng, 4)}"
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
            lambda rng: {"date": _date(rng), "time": "09:00"},
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
