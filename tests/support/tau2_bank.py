"""A small tau2 domain outside the tau2 package, written the way ToolOrchestra ships its
synthetic domains (``tools.py``, ``data_model.py``, ``db.json``, ``policy.md``), and its tasks
as rows of a ToolScale parquet file in the published layout (struct columns, one merged
``arguments`` struct, a null ``initial_state``), with a row of another domain."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

DATA_MODEL = '''
from pydantic import BaseModel, Field

from tau2.environment.db import DB


class Account(BaseModel):
    account_id: str = Field(description="The account's id")
    owner: str = Field(description="The account holder's name")
    balance: float = Field(description="The balance in dollars")


class BankDB(DB):
    """The bank's accounts."""

    accounts: dict[str, Account] = Field(description="Accounts by id")
'''

# As the reference's domains import their data model: the absolute name inside tau2.
TOOLS = '''
from tau2.domains.{name}.data_model import Account, BankDB
from tau2.environment.toolkit import ToolKitBase, ToolType, is_tool


class BankTools(ToolKitBase):
    """The bank's tools."""

    db: BankDB

    def __init__(self, db: BankDB) -> None:
        super().__init__(db)

    def _account(self, account_id: str) -> Account:
        if account_id not in self.db.accounts:
            raise ValueError(f"Account {{account_id}} not found")
        return self.db.accounts[account_id]

    @is_tool(ToolType.READ)
    def get_balance(self, account_id: str) -> float:
        """Get the balance of an account.

        Args:
            account_id: The account's id, such as 'A1'.

        Returns:
            The balance in dollars.
        """
        return self._account(account_id).balance

    @is_tool(ToolType.WRITE)
    def deposit(self, account_id: str, amount: float) -> Account:
        """Deposit money into an account.

        Args:
            account_id: The account's id, such as 'A1'.
            amount: The amount in dollars (positive).

        Returns:
            The account after the deposit.
        """
        if amount <= 0:
            raise ValueError("The amount must be positive")
        account = self._account(account_id)
        account.balance += amount
        return account
'''

DB_JSON = {
    "accounts": {
        "A1": {"account_id": "A1", "owner": "Ada Lovelace", "balance": 100.0},
        "A2": {"account_id": "A2", "owner": "Alan Turing", "balance": 250.0},
    }
}
POLICY = "# Bank policy\n\nYou are a bank agent. Deposit only what the account holder asks.\n"


def write_domain(parent: Path, name: str = "bank", tools: str = TOOLS) -> Path:
    """The domain's directory, ``parent/name``, in tau2's layout."""
    directory = parent / name
    directory.mkdir(parents=True)
    (directory / "data_model.py").write_text(textwrap.dedent(DATA_MODEL))
    (directory / "tools.py").write_text(textwrap.dedent(tools.format(name=name)))
    (directory / "db.json").write_text(json.dumps(DB_JSON))
    (directory / "policy.md").write_text(POLICY)
    return directory


def action(number: int, name: str, **arguments: Any) -> dict[str, Any]:
    return {
        "action_id": str(number),
        "name": name,
        "arguments": arguments,
        "requestor": "assistant",
    }


def task_row(
    task_id: str, domain: str, actions: list[dict[str, Any]], facts: list[str]
) -> dict[str, Any]:
    """A tau2 task as a published row (a struct fills in every key a row lacks as null)."""
    return {
        "id": task_id,
        "description": {"purpose": f"task {task_id}"},
        "user_scenario": {
            "instructions": {
                "domain": domain,
                "reason_for_call": "I want to manage my account.",
                "known_info": "You are Ada Lovelace, account A1.",
                "unknown_info": None,
                "task_instructions": "Ask for what you want, one thing at a time.",
            }
        },
        "evaluation_criteria": {
            "actions": actions,
            "communicate_info": facts,
            "reward_basis": ["DB", "COMMUNICATE"],
        },
    }


BANK_ROWS = [
    task_row(
        "deposit-50",
        "bank",
        [
            action(0, "get_balance", account_id="A1"),
            action(1, "deposit", account_id="A1", amount=50.0),
        ],
        ["150"],
    ),
    task_row("balance-A2", "bank", [action(0, "get_balance", account_id="A2")], ["250"]),
    # Another domain's row, its tool's argument in the merged struct: never read as bank's.
    task_row("forecast", "weather", [action(0, "get_forecast", city="Paris")], []),
    task_row("deposit-25", "bank", [action(0, "deposit", account_id="A2", amount=25.0)], []),
]


def write_rows(path: Path, rows: list[dict[str, Any]] = BANK_ROWS) -> Path:
    """``rows`` as a parquet file in the published layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from support.published_rows import published_schema

    arguments = pa.struct(
        [("account_id", pa.string()), ("amount", pa.float64()), ("city", pa.string())]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=published_schema(arguments)), path)
    return path
