"""A content-addressed store of calls to what lies outside the policy (LLM experts, judges, user
simulators, web search, HTTP and MCP tools): each call kept under the key of what determines its
answer, so that a rerun can answer from the store instead of calling again.

**The key** (:func:`call_key`) is a SHA-256 of the request as canonical JSON: the method, the
endpoint's URL and the JSON body, which holds the model, the messages and tools, the sampling
parameters and the seed where the endpoint takes one. Fields that carry secrets (``api_key``,
``authorization``, ``token``, ... at any depth) are left out of the key and of what is stored;
headers, where the project's clients send their keys, never reach the store.

**The file** is one SQLite database (write-ahead log), safe under concurrent writers: threads,
Ray workers, data-parallel ranks, each opening its own connection per operation and waiting up
to ``LOCK_TIMEOUT_S`` for the write lock. A call recorded twice keeps its first answer (the
one a replay has already given).

**The bound**: once the stored responses pass ``max_mb``, the least recently used calls (by
their last read or write) are evicted, oldest first, until they take at most ``EVICT_TO`` of the
bound. Every eviction is counted (:meth:`CallStore.stats`).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Field names whose values are secrets, matched case-insensitively after removing "-" and "_".
SECRET_FIELDS = frozenset({"apikey", "authorization", "token", "accesstoken", "password", "secret"})
LOCK_TIMEOUT_S = 60.0
EVICT_TO = 0.9

_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    key TEXT PRIMARY KEY,
    endpoint TEXT NOT NULL,
    request TEXT NOT NULL,
    response TEXT NOT NULL,
    seconds REAL NOT NULL,
    bytes INTEGER NOT NULL,
    recorded_at REAL NOT NULL,
    used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_by_use ON calls (used_at);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


def without_secrets(value: Any) -> Any:
    """``value`` (JSON) with every field that carries a secret left out, at any depth."""
    if isinstance(value, Mapping):
        return {
            key: without_secrets(item)
            for key, item in value.items()
            if str(key).lower().replace("-", "").replace("_", "") not in SECRET_FIELDS
        }
    if isinstance(value, list | tuple):
        return [without_secrets(item) for item in value]
    return value


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def call_key(method: str, url: str, payload: Any) -> str:
    """The key of a call: what determines its answer (module docstring), secrets left out."""
    request = {"method": method.upper(), "url": url, "body": without_secrets(payload)}
    return hashlib.sha256(_canonical(request).encode()).hexdigest()


@dataclass(frozen=True)
class StoredCall:
    """A recorded call: its endpoint, request (secrets left out), response, seconds it took
    when recorded and when (``time.time()``)."""

    key: str
    endpoint: str
    request: Any
    response: Any
    seconds: float
    recorded_at: float


class CallStore:
    """The store in the SQLite file ``path`` (made with its directory where missing), bounded
    at ``max_mb`` MiB of stored requests and responses."""

    def __init__(self, path: str | Path, max_mb: float = 1024.0) -> None:
        if max_mb <= 0:
            raise ValueError("a call store's max_mb must be > 0")
        self.path, self.max_bytes = Path(path), int(max_mb * 2**20)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connection() as connection:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.executescript(_SCHEMA)

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        """A connection of this operation's own (threads and processes never share one), in
        autocommit: a write that needs several statements opens its own transaction."""
        connection = sqlite3.connect(self.path, timeout=LOCK_TIMEOUT_S, isolation_level=None)
        try:
            yield connection
        finally:
            connection.close()

    def get(self, key: str) -> StoredCall | None:
        """The call recorded under ``key`` (None: none), marked as used now."""
        with self._connection() as connection:
            row = connection.execute(
                "SELECT key, endpoint, request, response, seconds, recorded_at FROM calls "
                "WHERE key = ?",
                (key,),
            ).fetchone()
            if row is None:
                return None
            connection.execute("UPDATE calls SET used_at = ? WHERE key = ?", (time.time(), key))
        return StoredCall(
            key=row[0],
            endpoint=row[1],
            request=json.loads(row[2]),
            response=json.loads(row[3]),
            seconds=row[4],
            recorded_at=row[5],
        )

    def put(self, key: str, endpoint: str, request: Any, response: Any, seconds: float) -> bool:
        """Record a call (its request kept without secrets); False where ``key`` was recorded
        already (the first answer stays). Evicts past the bound."""
        request_text = _canonical(without_secrets(request))
        response_text = _canonical(response)
        size = len(request_text.encode()) + len(response_text.encode())
        now = time.time()
        with self._connection() as connection:
            connection.execute("BEGIN IMMEDIATE")
            try:
                added = connection.execute(
                    "INSERT OR IGNORE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (key, endpoint, request_text, response_text, seconds, size, now, now),
                ).rowcount
                if added:
                    self._evict(connection)
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
        return bool(added)

    def _evict(self, connection: sqlite3.Connection) -> None:
        """Least recently used calls out until the rest take at most ``EVICT_TO`` of the
        bound (inside the writer's transaction)."""
        (total,) = connection.execute("SELECT COALESCE(SUM(bytes), 0) FROM calls").fetchone()
        if total <= self.max_bytes:
            return
        target, evicted = EVICT_TO * self.max_bytes, 0
        for key, size in connection.execute(
            "SELECT key, bytes FROM calls ORDER BY used_at, recorded_at"
        ).fetchall():
            if total <= target:
                break
            connection.execute("DELETE FROM calls WHERE key = ?", (key,))
            total, evicted = total - size, evicted + 1
        connection.execute(
            "INSERT INTO counters VALUES ('evicted', ?) "
            "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (evicted,),
        )

    def stats(self) -> dict[str, int]:
        """``calls`` stored, their ``bytes`` and the calls ``evicted`` so far."""
        with self._connection() as connection:
            calls, size = connection.execute(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM calls"
            ).fetchone()
            evicted = connection.execute(
                "SELECT COALESCE(MAX(value), 0) FROM counters WHERE name = 'evicted'"
            ).fetchone()[0]
        return {"calls": calls, "bytes": size, "evicted": evicted}
