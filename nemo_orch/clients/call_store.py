"""A content-addressed store of calls to what lies outside the policy (LLM experts, judges, user
simulators, web search, HTTP and MCP tools): each call kept under the key of what determines its
answer, so that a rerun can answer from the store instead of calling again.

**The key** (:func:`call_key`) is a SHA-256 of the request as canonical JSON: the method, the
endpoint's URL (for a server on this machine its path alone: a server a run starts gets another
port each time) and the JSON body, which holds the model, the messages and tools, the sampling
parameters and the seed where the endpoint takes one. Fields that carry secrets (``api_key``,
``authorization``, ``token``, ... at any depth) are left out of the key and of what is stored;
headers, where the project's clients send their keys, never reach the store.

**The file** is one SQLite database (write-ahead log), each call stored with the name of its
episode's scope where one was open (:func:`episode_scope`; :meth:`CallStore.copy_episode` copies
an episode's calls out), safe under concurrent writers: threads,
Ray workers, data-parallel ranks, each opening its own connection per operation and waiting up
to ``LOCK_TIMEOUT_S`` for the write lock. A call recorded twice keeps its first answer (the
one a replay has already given).

**Modes** (``calls.mode``, :class:`Recording`, made the process's own by :func:`recording`):
``record`` calls and keeps each answer; ``replay`` answers from the store, a call it does not
hold failing as an infrastructure error (:class:`StoreMiss`, counted); ``replay_or_call``
answers from the store where it can and calls (and keeps) where not. A call answered from the
store is noted for the ledger (:func:`noting_calls`): it takes the seconds it took when
recorded, is billed at its recorded cost in reports and at $0 in what the run spent.

**The bound**: once the stored responses pass ``max_mb``, the least recently used calls (by
their last read or write) are evicted, oldest first, until they take at most ``EVICT_TO`` of the
bound. Every eviction is counted (:meth:`CallStore.stats`).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nemo_orch import faults
from nemo_orch.clients.sse import EventStream
from nemo_orch.config import CallsConfig

log = logging.getLogger(__name__)

# Field names whose values are secrets, matched case-insensitively after removing "-" and "_".
SECRET_FIELDS = frozenset({"apikey", "authorization", "token", "accesstoken", "password", "secret"})
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
LOCK_TIMEOUT_S = 60.0
EVICT_TO = 0.9

_COLUMNS = "key, endpoint, request, response, seconds, bytes, recorded_at, used_at, episode"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    key TEXT PRIMARY KEY,
    endpoint TEXT NOT NULL,
    request TEXT NOT NULL,
    response TEXT NOT NULL,
    seconds REAL NOT NULL,
    bytes INTEGER NOT NULL,
    recorded_at REAL NOT NULL,
    used_at REAL NOT NULL,
    episode TEXT
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


def endpoint_of(url: str) -> str:
    """What names an endpoint in a key: its URL, but for a server on this machine its path
    alone (a local server a run starts gets a free port, another one each run)."""
    parts = urlsplit(url)
    return parts.path if parts.hostname in LOCAL_HOSTS else url


def digest(request: Any) -> str:
    """The key of a request (JSON): a SHA-256 of its canonical form."""
    return hashlib.sha256(_canonical(request).encode()).hexdigest()


def call_key(method: str, url: str, payload: Any) -> str:
    """The key of a call: what determines its answer (module docstring), secrets left out."""
    return digest(
        {"method": method.upper(), "endpoint": endpoint_of(url), "body": without_secrets(payload)}
    )


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
        self._local = threading.local()
        connection = self._connection()
        connection.execute("PRAGMA journal_mode=WAL")
        connection.executescript(_SCHEMA)
        columns = {row[1] for row in connection.execute("PRAGMA table_info(calls)")}
        if "episode" not in columns:  # a store made before calls named their episode
            connection.execute("ALTER TABLE calls ADD COLUMN episode TEXT")

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (threads and processes never share one; a forked process
        opens its own), in autocommit: a write of several statements opens a transaction. WAL
        with ``synchronous=NORMAL``: a commit survives the process being killed."""
        connection, pid = getattr(self._local, "connection", None), os.getpid()
        if connection is None or self._local.pid != pid:
            connection = sqlite3.connect(self.path, timeout=LOCK_TIMEOUT_S, isolation_level=None)
            connection.execute("PRAGMA synchronous=NORMAL")
            self._local.connection, self._local.pid = connection, pid
        return connection

    def get(self, key: str) -> StoredCall | None:
        """The call recorded under ``key`` (None: none), marked as used now."""
        connection = self._connection()
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

    def put(
        self,
        key: str,
        endpoint: str,
        request: Any,
        response: Any,
        seconds: float,
        episode: str | None = None,
    ) -> bool:
        """Record a call (its request kept without secrets) of ``episode`` (its scope's name;
        None: of none); False where ``key`` was recorded already (the first answer stays).
        Evicts past the bound."""
        request_text = _canonical(without_secrets(request))
        response_text = _canonical(response)
        size = len(request_text.encode()) + len(response_text.encode())
        now = time.time()
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            added = connection.execute(
                f"INSERT OR IGNORE INTO calls ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key, endpoint, request_text, response_text, seconds, size, now, now, episode),
            ).rowcount
            if added:
                self._count(connection, "bytes", size)
                self._evict(connection)
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        return bool(added)

    @staticmethod
    def _count(connection: sqlite3.Connection, name: str, change: int) -> int:
        """Add ``change`` to the counter ``name`` (inside the writer's transaction); its value."""
        connection.execute(
            "INSERT INTO counters VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (name, change),
        )
        return connection.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()[
            0
        ]

    def _evict(self, connection: sqlite3.Connection) -> None:
        """Least recently used calls out until the rest take at most ``EVICT_TO`` of the
        bound (inside the writer's transaction)."""
        total = self._count(connection, "bytes", 0)
        if total <= self.max_bytes:
            return
        target, evicted, freed = EVICT_TO * self.max_bytes, 0, 0
        for key, size in connection.execute(
            "SELECT key, bytes FROM calls ORDER BY used_at, recorded_at"
        ).fetchall():
            if total - freed <= target:
                break
            connection.execute("DELETE FROM calls WHERE key = ?", (key,))
            evicted, freed = evicted + 1, freed + size
        self._count(connection, "bytes", -freed)
        self._count(connection, "evicted", evicted)

    def copy_episode(self, episode: str, into: CallStore) -> int:
        """The calls of episode ``episode`` (an episode id, ``<task>#<sample>``: every scope of
        it, whatever its seed and weights; or a scope's whole name) copied into ``into``, as
        recorded: what a bug report ships. How many were copied."""
        rows = [
            row
            for row in self._connection().execute(f"SELECT {_COLUMNS} FROM calls").fetchall()
            if row[-1] is not None and (row[-1] == episode or row[-1].startswith(f"{episode}@"))
        ]
        target = into._connection()
        target.execute("BEGIN IMMEDIATE")
        try:
            copied = [
                row
                for row in rows
                if target.execute(
                    f"INSERT OR IGNORE INTO calls ({_COLUMNS}) VALUES ({', '.join('?' * 9)})", row
                ).rowcount
            ]
            into._count(target, "bytes", sum(row[5] for row in copied))
            target.execute("COMMIT")
        except BaseException:
            target.execute("ROLLBACK")
            raise
        return len(copied)

    def stats(self) -> dict[str, int]:
        """``calls`` stored, their ``bytes`` and the calls ``evicted`` so far."""
        connection = self._connection()
        (calls,) = connection.execute("SELECT COUNT(*) FROM calls").fetchone()
        counters = dict(connection.execute("SELECT name, value FROM counters").fetchall())
        return {
            "calls": calls,
            "bytes": counters.get("bytes", 0),
            "evicted": counters.get("evicted", 0),
        }


class StoreMiss(RuntimeError):
    """``calls.mode=replay`` and the store does not hold the call."""


def _encoded(body: Any) -> Any:
    """A response as stored: JSON as it is, a server-sent-event stream marked as one."""
    return {"event_stream": list(body)} if isinstance(body, EventStream) else {"json": body}


def _decoded(stored: Any) -> Any:
    return EventStream(stored["event_stream"]) if "event_stream" in stored else stored["json"]


@dataclass
class Recording:
    """The store in a mode (``calls.*``): :meth:`call` answers a request from ``store`` or
    calls ``live`` (and keeps its answer), as the mode says; the counts say what happened."""

    store: CallStore
    mode: str
    # Read and write the store in the event loop's own thread rather than a worker thread:
    # where calls join batches by timing (the policy's turns), a thread's timing would change
    # which batch a call joins, and with it the last bits of its logprobs.
    inline: bool = False
    replayed: int = 0
    recorded: int = 0
    missed: int = 0

    async def call(
        self,
        method: str,
        url: str,
        payload: Any,
        live: Callable[[], Awaitable[Any]],
        encode: Callable[[Any], Any] = _encoded,
        decode: Callable[[Any], Any] = _decoded,
    ) -> Any:
        """A request (keyed by :func:`call_key`) through the store."""
        return await self.through(
            call_key(method, url, payload), url, payload, live, encode, decode
        )

    async def through(
        self,
        key: str,
        endpoint: str,
        request: Any,
        live: Callable[[], Awaitable[Any]],
        encode: Callable[[Any], Any] = _encoded,
        decode: Callable[[Any], Any] = _decoded,
    ) -> Any:
        """``live()``'s answer, or the stored one, as the mode says; ``key`` made the
        episode's own where an :func:`episode_scope` is open (``encode``/``decode``: the answer
        as stored, and back)."""
        scope = _scope.get()
        key = key if scope is None else scope.key(key)
        if self.mode in ("replay", "replay_or_call"):
            stored = await self._in_store(self.store.get, key)
            if stored is not None:
                self.replayed += 1
                _note(stored.seconds, replayed=True)
                return decode(stored.response)
            self.missed += 1
            if self.mode == "replay":
                raise StoreMiss(f"{endpoint}: not in the call store {self.store.path} (replay)")
        started = time.perf_counter()
        answer = await live()
        seconds = time.perf_counter() - started
        _note(seconds, replayed=False)
        if self.mode in ("record", "replay_or_call"):
            kept = encode(answer)
            episode = None if scope is None else scope.name
            if await self._in_store(self.store.put, key, endpoint, request, kept, seconds, episode):
                self.recorded += 1
                faults.maybe_kill("call", self.recorded)  # tests: killed after the n-th kept
        return answer

    async def _in_store(self, operation: Callable[..., Any], *args: Any) -> Any:
        return operation(*args) if self.inline else await asyncio.to_thread(operation, *args)

    def counts(self) -> dict[str, int]:
        return {"replayed": self.replayed, "recorded": self.recorded, "missed": self.missed}


@dataclass
class EpisodeScope:
    """The episode the calls of a block belong to (``name``), and how often each request was
    made in it so far: the n-th identical request of an episode is a call of its own."""

    name: str
    made: dict[str, int] = field(default_factory=dict)

    def key(self, key: str) -> str:
        occurrence = self.made.get(key, 0)
        self.made[key] = occurrence + 1
        return hashlib.sha256(f"{self.name}\0{key}\0{occurrence}".encode()).hexdigest()


_scope: contextvars.ContextVar[EpisodeScope | None] = contextvars.ContextVar(
    "call_store_scope", default=None
)


@contextmanager
def episode_scope(name: str) -> Iterator[EpisodeScope]:
    """Within the block, every call through the store is the episode ``name``'s own: keyed by
    the episode and the request's occurrence in it, so that a rerun of the episode (a resumed
    run, a replayed evaluation) gets back each of its own answers, in order, and no other
    episode's."""
    with within(EpisodeScope(name)) as scope:
        yield scope


@contextmanager
def within(scope: EpisodeScope) -> Iterator[EpisodeScope]:
    """``scope``'s episode the one of the block's calls (an episode driven a request at a time
    enters its scope for each)."""
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


_active: Recording | None = None
# The calls of the current block that went through the store (see noting_calls).
_noted: contextvars.ContextVar[list[NotedCall] | None] = contextvars.ContextVar(
    "call_store_noted", default=None
)


def active() -> Recording | None:
    """The recording every client of this process goes through (None: calls go out as they
    are)."""
    return _active


def activate(config: CallsConfig) -> Recording | None:
    """Make ``config``'s store this process's recording (none for ``calls.mode=off``): every
    client goes through it from now on (a Ray worker's process calls this at its start)."""
    global _active
    _active = (
        None
        if config.mode == "off" or config.store is None
        else Recording(CallStore(config.store, config.max_mb), config.mode)
    )
    return _active


async def kept(
    method: str,
    url: str,
    payload: Any,
    live: Callable[[], Awaitable[Any]],
    encode: Callable[[Any], Any],
    decode: Callable[[Any], Any],
) -> tuple[Any, float | None]:
    """A call that is not an HTTP request (an MCP tool's, a sandbox's run; named by ``url``)
    through the process's recording where one is active: its answer, and the seconds it took
    when recorded where the store answered it (None: it ran now). Raises :class:`StoreMiss`
    where the recording replays and does not hold it."""
    if _active is None:
        return await live(), None
    with noting_calls() as noted:
        answer = await _active.call(method, url, payload, live, encode, decode)
    return answer, (noted[-1].seconds if noted and noted[-1].replayed else None)


@contextmanager
def using(recording: Recording) -> Iterator[Recording]:
    """``recording`` the process's own while the block runs."""
    global _active
    _active = recording
    try:
        yield recording
    finally:
        _active = None


@contextmanager
def recording(config: CallsConfig) -> Iterator[Recording | None]:
    """:func:`activate` for the block; what the recording did is logged at its end."""
    global _active
    active = activate(config)
    try:
        yield active
    finally:
        if active is not None:
            log.info("call store %s (%s): %s", config.store, config.mode, active.counts())
        _active = None


@dataclass(frozen=True)
class NotedCall:
    """A call through the store: the seconds it took (when recorded, for one replayed) and
    whether it was answered from the store."""

    seconds: float
    replayed: bool


def _note(seconds: float, replayed: bool) -> None:
    noted = _noted.get()
    if noted is not None:
        noted.append(NotedCall(seconds, replayed))


@contextmanager
def noting_calls() -> Iterator[list[NotedCall]]:
    """Within the block (one tool call, one request), the calls that went through the store
    (none while it is off), so that a replay reports the seconds its recording took: a rerun
    reports what the recorded run did. Blocks nest: what an inner one notes, the outer one
    notes too."""
    outer = _noted.get()
    noted: list[NotedCall] = []
    token = _noted.set(noted)
    try:
        yield noted
    finally:
        _noted.reset(token)
        if outer is not None:
            outer.extend(noted)
