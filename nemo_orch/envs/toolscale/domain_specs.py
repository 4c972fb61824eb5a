"""The declared schemas of the offline ToolScale domains: tables, tools and policy, as data.

Each of ``shop``, ``clinic`` and ``mobile`` is a :class:`~nemo_orch.data.domain.DomainSpec` in its
JSON form, with 12-15 read and write tools. The seeded records that fill them are drawn in
:mod:`.domain_records`; this module is declarations only, kept apart from the drawing code.
"""

from __future__ import annotations

from typing import Any

DOMAINS = ("shop", "clinic", "mobile")


def _field(kind: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, **extra}


SPECS: dict[str, dict[str, Any]] = {
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
