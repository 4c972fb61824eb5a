"""``calls.*``: the store of calls to what lies outside the policy (record, replay)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_orch.config.base import _require

CALL_MODES = ("off", "record", "replay", "replay_or_call")


@dataclass
class CallsConfig:
    """The call store (:mod:`nemo_orch.clients.call_store`) every HTTP call outside the policy
    goes through (LLM experts, judges, user simulators, web search, remote tools). ``record``:
    call, and keep each answer in ``store``; ``replay``: answer from ``store``, a call it does
    not hold failing as an infrastructure error (counted, no network); ``replay_or_call``:
    answer from ``store`` where it holds the call, else call and keep the answer."""

    # off | record | replay | replay_or_call
    mode: str = "off"
    # The store's SQLite file (shared by every process of a run; safe under concurrent writers).
    store: Optional[str] = None
    # The store's bound in MiB: past it the least recently used calls are evicted.
    max_mb: float = 1024.0

    def __post_init__(self) -> None:
        _require(
            self.mode in CALL_MODES, f"calls.mode must be {'|'.join(CALL_MODES)}, got {self.mode!r}"
        )
        _require(
            self.mode == "off" or bool(self.store), f"calls.mode={self.mode} needs calls.store"
        )
        _require(self.max_mb > 0, "calls.max_mb must be > 0")
