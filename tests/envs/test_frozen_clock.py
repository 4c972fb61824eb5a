"""The frozen clock of domain environments (:mod:`nemo_orch.envs.clock`): a domain whose write
tools store the wall clock scores a correct agent 1.0 even when the evaluator replays the gold
actions in a later second, and no code outside the domain, no other thread and no other asyncio
task sees a frozen clock."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from nemo_orch.envs.clock import DOMAIN_PACKAGE, INSTANT, domain_clock

# A domain module reading the clock in every way the stand-ins cover.
PROBE = """
import datetime
import time
from datetime import date
from datetime import datetime as dt
from time import time as epoch


def readings():
    return {"utcnow": dt.utcnow(), "now": dt.now(), "today": dt.today(),
            "module_now": datetime.datetime.now(), "date_today": date.today(),
            "module_date_today": datetime.date.today(), "time": time.time(), "epoch": epoch(),
            "time_ns": time.time_ns(), "now_utc": dt.now(datetime.timezone.utc)}
"""
FROZEN = {
    "utcnow": INSTANT,
    "now": INSTANT,
    "today": INSTANT,
    "module_now": INSTANT,
    "date_today": INSTANT.date(),
    "module_date_today": INSTANT.date(),
    "time": 1715785200.0,
    "epoch": 1715785200.0,
    "time_ns": 1715785200 * 10**9,
    "now_utc": INSTANT.replace(tzinfo=datetime.UTC),
}


@pytest.fixture
def probe():
    """A module of the domain package (the name is all the clock looks at)."""
    module = types.ModuleType(f"{DOMAIN_PACKAGE}._clock_probe")
    exec(PROBE, vars(module))
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _is_real(readings: dict[str, Any]) -> bool:
    return (
        readings["date_today"] == datetime.date.today() and abs(readings["time"] - time.time()) < 60
    )


def test_the_domains_clock_is_frozen_inside_the_scope_only(probe):
    assert _is_real(probe.readings())
    with domain_clock():
        assert probe.readings() == FROZEN
        # Code outside the domain package keeps the real clock.
        assert datetime.date.today() != INSTANT.date()
    assert _is_real(probe.readings())


def test_the_stand_ins_make_real_datetimes(probe):
    """Domain code that builds, parses and type-checks dates gets real ones."""
    with domain_clock():
        stamp = probe.dt.utcnow()
        made = [
            probe.dt(2024, 1, 2),
            probe.dt.fromisoformat("2024-01-02T03:04:05"),
            probe.dt.strptime("2024", "%Y"),
            probe.date(2024, 1, 2),
            probe.dt.combine(probe.date(2024, 1, 2), datetime.time(3)),
        ]
    assert {type(value) for value in made} == {datetime.datetime, datetime.date}
    assert type(stamp) is datetime.datetime and isinstance(stamp, probe.dt)
    assert isinstance(datetime.date(2024, 1, 2), probe.date)
    assert issubclass(datetime.datetime, probe.datetime.datetime)


def test_other_threads_and_asyncio_tasks_keep_their_own_clock(probe):
    """The instant belongs to the context that entered the scope: a thread running meanwhile
    reads the real clock, and episodes interleaved in one event loop each read theirs."""
    later = datetime.datetime(2025, 2, 25, 12, 8)
    seen: dict[str, Any] = {}
    entered, read = threading.Event(), threading.Event()

    def other_thread() -> None:
        entered.wait(5)
        seen["thread"] = probe.readings()
        read.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with domain_clock():
        entered.set()
        assert read.wait(5)
        assert probe.readings() == FROZEN
    thread.join()
    assert _is_real(seen["thread"])

    async def episode(name: str, instant: datetime.datetime) -> None:
        with domain_clock(instant):
            for step in range(3):
                seen[f"{name}{step}"] = probe.dt.utcnow()
                await asyncio.sleep(0)  # the other episode runs here

    async def both() -> None:
        await asyncio.gather(episode("a", INSTANT), episode("b", later))

    asyncio.run(both())
    assert [seen[f"a{step}"] for step in range(3)] == [INSTANT] * 3
    assert [seen[f"b{step}"] for step in range(3)] == [later] * 3


# A tau2 domain directory written as ToolOrchestra's are, whose write tools store the clock:
# deposit through a helper module (``from datetime import datetime``, ``utcnow()``) and returns
# the balance; withdraw in tools.py itself (``import datetime``, ``datetime.datetime.now()`` and
# ``time.time()``, to the second) and returns the entry it stored.
DATA_MODEL = '''
from datetime import datetime
from typing import Optional

from pydantic import BaseModel, Field

from tau2.environment.db import DB


class Entry(BaseModel):
    kind: str = Field(description="deposit or withdrawal")
    amount: float = Field(description="The amount in dollars")
    at: datetime = Field(description="When (UTC)")
    epoch: Optional[int] = Field(default=None, description="When, in seconds since 1970")


class Account(BaseModel):
    account_id: str = Field(description="The account's id")
    balance: float = Field(description="The balance in dollars")
    entries: list[Entry] = Field(default_factory=list, description="The account's history")


class ClockBankDB(DB):
    """The bank's accounts."""

    accounts: dict[str, Account] = Field(description="Accounts by id")
'''
STAMPS = """
from datetime import datetime


def utc_stamp() -> datetime:
    return datetime.utcnow()
"""
TOOLS = '''
import datetime
import time

from tau2.domains.clock_bank.data_model import Account, ClockBankDB, Entry
from tau2.environment.toolkit import ToolKitBase, ToolType, is_tool

from .stamps import utc_stamp


class ClockBankTools(ToolKitBase):
    """The bank's tools."""

    db: ClockBankDB

    def __init__(self, db: ClockBankDB) -> None:
        super().__init__(db)

    def _account(self, account_id: str) -> Account:
        if account_id not in self.db.accounts:
            raise ValueError(f"Account {account_id} not found")
        return self.db.accounts[account_id]

    @is_tool(ToolType.WRITE)
    def deposit(self, account_id: str, amount: float) -> float:
        """Deposit money into an account.

        Args:
            account_id: The account's id, such as 'A1'.
            amount: The amount in dollars.

        Returns:
            The new balance.
        """
        account = self._account(account_id)
        account.balance += amount
        account.entries.append(Entry(kind="deposit", amount=amount, at=utc_stamp()))
        return account.balance

    @is_tool(ToolType.WRITE)
    def withdraw(self, account_id: str, amount: float) -> Entry:
        """Withdraw money from an account.

        Args:
            account_id: The account's id, such as 'A1'.
            amount: The amount in dollars.

        Returns:
            The account's new entry.
        """
        account = self._account(account_id)
        account.balance -= amount
        entry = Entry(kind="withdrawal", amount=amount,
                      at=datetime.datetime.now().replace(microsecond=0), epoch=int(time.time()))
        account.entries.append(entry)
        return entry
'''
DB_JSON = {"accounts": {"A1": {"account_id": "A1", "balance": 100.0, "entries": []}}}


def _task(task_id: str, tool: str) -> dict[str, Any]:
    return {
        "id": task_id,
        "description": None,
        "initial_state": None,
        "user_scenario": {"persona": None, "instructions": f"{tool} 20 on A1."},
        "evaluation_criteria": {
            "actions": [
                {
                    "action_id": "0",
                    "name": tool,
                    "info": None,
                    "arguments": {"account_id": "A1", "amount": 20.0},
                }
            ],
            "communicate_info": [],
            "reward_basis": ["DB"],
        },
    }


def write_clock_bank(parent: Path) -> Path:
    directory = parent / "clock_bank"
    directory.mkdir()
    for name, text in (("data_model.py", DATA_MODEL), ("stamps.py", STAMPS), ("tools.py", TOOLS)):
        (directory / name).write_text(textwrap.dedent(text))
    (directory / "db.json").write_text(json.dumps(DB_JSON))
    (directory / "policy.md").write_text("# Clock bank\n\nDo what the account holder asks.\n")
    (directory / "tasks.json").write_text(
        json.dumps([_task("deposit", "deposit"), _task("withdraw", "withdraw")])
    )
    return directory


@pytest.fixture(scope="module")
def clock_bank(tmp_path_factory):
    """The domain, registered once (tau2's registry lives as long as the process)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    pytest.importorskip("tau2")
    from nemo_orch.envs.tau2.adapter import load_domain
    from nemo_orch.envs.tau2.external import register_domain_directory

    register_domain_directory(write_clock_bank(tmp_path_factory.mktemp("domains")))
    return load_domain("clock_bank", "test")


def _sleep_past_the_second() -> None:
    time.sleep(1.02 - time.time() % 1)


@pytest.mark.tau2
def test_the_domains_tools_store_the_frozen_instant(clock_bank):
    from tau2.data_model.message import ToolCall
    from tau2.registry import registry

    environment = registry.get_env_constructor("clock_bank")()
    with domain_clock():
        for tool in ("deposit", "withdraw"):
            response = environment.get_response(
                ToolCall(id=tool, name=tool, arguments={"account_id": "A1", "amount": 5.0})
            )
            assert not response.error, response.content
    entries = environment.tools.db.accounts["A1"].entries
    assert [(entry.kind, entry.at, entry.epoch) for entry in entries] == [
        ("deposit", INSTANT, None),
        ("withdrawal", INSTANT, int(FROZEN["time"])),
    ]


@pytest.mark.tau2
def test_a_gold_replay_scored_a_second_later_passes_and_fails_without_the_clock(
    clock_bank, monkeypatch
):
    """The agent's calls run in one second, tau2's evaluator replays them and the gold actions
    in the next: with the clock both tasks score 1.0. Without it (the control), the evaluator's
    replays of the agent's deposit and of the gold one store different microseconds, and the
    withdrawal's replay returns an entry of another second than the agent was shown."""
    from support.tau2_replay import gold_replay_turns

    from nemo_orch.envs.tau2 import adapter

    tasks = {task.metadata["tau2_task"]["id"]: task for task in clock_bank.tasks}
    frozen = {
        name: asyncio.run(gold_replay_turns(clock_bank, task)) for name, task in tasks.items()
    }
    with monkeypatch.context() as unfrozen:
        unfrozen.setattr(adapter, "domain_clock", contextlib.nullcontext)
        real = {
            name: asyncio.run(gold_replay_turns(clock_bank, task)) for name, task in tasks.items()
        }
    _sleep_past_the_second()
    for name, task in tasks.items():
        score = adapter.score_episode(task, frozen[name])
        assert score.reward == 1.0, score.failures
    with monkeypatch.context() as unfrozen:
        unfrozen.setattr(adapter, "domain_clock", contextlib.nullcontext)
        deposit = adapter.score_episode(tasks["deposit"], real["deposit"])
        withdraw = adapter.score_episode(tasks["withdraw"], real["withdraw"])
    assert deposit.reward == 0.0 and deposit.failures == (
        "the database differs from the one the gold actions leave",
    )
    assert withdraw.reward == 0.0 and "could not replay" in withdraw.failures[0]
