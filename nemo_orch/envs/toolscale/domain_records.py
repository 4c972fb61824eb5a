"""The seeded records of the offline ToolScale domains, and the domains built from them.

:func:`generate_domain` fills a domain declared in :mod:`.domain_specs` with records drawn from a
seed (customers, orders, patients, bills, ...). The small seeded value helpers (an address, a date,
a run of digits) are shared with the task generator, whose goals draw new values the same way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from nemo_orch.data.domain import Database, Domain, DomainSpec
from nemo_orch.envs.toolscale.domain_specs import DOMAINS, SPECS

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


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(_FIRST), rng.choice(_LAST)


def random_address(rng: random.Random) -> str:
    """A street address, e.g. ``"12 Oak St"``."""
    return f"{rng.randint(1, 999)} {rng.choice(_STREETS)}"


def random_digits(rng: random.Random, count: int) -> str:
    """``count`` decimal digits (a zip code, a phone number's tail)."""
    return "".join(rng.choice("0123456789") for _ in range(count))


def random_date(rng: random.Random) -> str:
    """A date in 2026, ``YYYY-MM-DD``."""
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
                "zip": random_digits(rng, 5),
                "email": f"{first}.{last}{i}@mail.test".lower(),
                "address": random_address(rng),
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
    specialties = SPECS["clinic"]["tables"]["doctors"]["fields"]["specialty"]["enum"]
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
                "phone": f"555-{random_digits(rng, 4)}",
                "insurance": rng.choice(["none", "basic", "premium"]),
            }
        )
    appointments = [
        {
            "appointment_id": f"A{i}",
            "patient_id": rng.choice(patients)["patient_id"],
            "doctor_id": rng.choice(doctors)["doctor_id"],
            "date": random_date(rng),
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
                "phone": f"555-{random_digits(rng, 4)}",
                "email": f"{first}{i}@carrier.test".lower(),
                "balance": float(rng.randint(0, 50)),
            }
        )
    lines = [
        {
            "line_id": f"L{i}",
            "subscriber_id": subscribers[(i - 1) % 40]["subscriber_id"],
            "number": f"555-{random_digits(rng, 4)}",
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
    if name not in SPECS:
        raise ValueError(f"unknown offline domain {name!r}; one of {DOMAINS}")
    spec = DomainSpec.from_json(SPECS[name], f"offline domain {name}")
    return Domain(spec, spec.check_database(_RECORDS[name](random.Random(seed))))
