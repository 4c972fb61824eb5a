"""A frozen clock for domain environments' own code, so that every run of a task's tools (the
agent's episode, the gold replay, the evaluator's replays of both) sees the same instant.

Domain tools that write the wall clock into their database (ToolOrchestra's synthetic domains
store ``datetime.utcnow()``) otherwise leave databases that differ between the agent's episode
and the evaluator's gold replay, one second apart: a correct agent scores 0 at random.

Inside :func:`domain_clock`, the modules of tau2's domain package (``tau2.domains.*``: tau2's
own domains and the directories registered with it, :mod:`nemo_orch.envs.tau2.external`) read
the frozen instant from ``datetime.datetime.now / utcnow / today``, ``datetime.date.today`` and
``time.time / time_ns``, whether they imported the module (``import datetime``) or the name
(``from datetime import datetime``). The instant is naive UTC, and ``now()`` returns it as if
the machine ran in UTC (as tau2's airline domain, whose "now" it is, states its times).

Only those modules' names are replaced (by stand-ins that read the real clock outside the
scope, patched in when a scope opens after an import), and the instant is a context variable,
so no other code, thread or asyncio task ever sees a frozen clock: other threads (HTTP servers,
the generation batcher) run on, and episodes interleaved in one event loop each keep their own
scope. A global patch (freezegun) would freeze every thread's clock, and its start walks every
loaded module (1.6 s per start with torch and transformers loaded). Not covered: a domain that
captured a clock function at import (``Field(default_factory=datetime.utcnow)``) or reads it in
a module outside ``tau2.domains``.

ToolScale domains of our own (:mod:`nemo_orch.data.domain`) are declared operations that never
read the clock; ToolScale rows of tau2 domains run in tau2 and are covered here.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

# tau2 airline's "now" (its tools' _get_datetime): tau2's own domains fix their clock in code,
# and tasks state no instant of their own, so one instant serves every task.
INSTANT = datetime.datetime(2024, 5, 15, 15, 0, 0)
DOMAIN_PACKAGE = "tau2.domains"

_instant: contextvars.ContextVar[datetime.datetime | None] = contextvars.ContextVar(
    "domain_clock_instant", default=None
)


class _StandIn(type):
    """The metaclass of the stand-in classes: real dates and datetimes are their instances,
    as domain code that type-checks its values expects."""

    _real: type

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls._real)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls._real)


class _Datetime(datetime.datetime, metaclass=_StandIn):
    """``datetime.datetime`` whose clock is the frozen instant inside :func:`domain_clock`;
    everything it makes is a real ``datetime``."""

    _real = datetime.datetime

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # fromisoformat, strptime, combine... build through cls(...): real datetimes too.
        return datetime.datetime(*args, **kwargs)

    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> Any:
        instant = _instant.get()
        if instant is None:
            return datetime.datetime.now(tz)
        return instant if tz is None else instant.replace(tzinfo=datetime.UTC).astimezone(tz)

    @classmethod
    def utcnow(cls) -> Any:
        instant = _instant.get()
        # utcnow is what the domain asked for; its deprecation warning (3.12) is the domain's.
        return datetime.datetime.utcnow() if instant is None else instant

    @classmethod
    def today(cls) -> Any:
        return cls.now()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # A data model that resolves its annotations late sees this class: validate as datetime.
        return handler(datetime.datetime)


class _Date(datetime.date, metaclass=_StandIn):
    """``datetime.date`` whose ``today()`` is the frozen instant's date inside
    :func:`domain_clock`; everything it makes is a real ``date``."""

    _real = datetime.date

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return datetime.date(*args, **kwargs)

    @classmethod
    def today(cls) -> Any:
        instant = _instant.get()
        return datetime.date.today() if instant is None else instant.date()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        return handler(datetime.date)


_EPOCH = datetime.datetime(1970, 1, 1)


def _time() -> float:
    instant = _instant.get()
    return time.time() if instant is None else (instant - _EPOCH).total_seconds()


def _time_ns() -> int:
    instant = _instant.get()
    return (
        time.time_ns()
        if instant is None
        else (instant - _EPOCH) // datetime.timedelta(microseconds=1) * 1000
    )


def _module_copy(module: types.ModuleType, **replaced: Any) -> types.ModuleType:
    """A module object with ``module``'s attributes, ``replaced`` replacing some."""
    copy = types.ModuleType(module.__name__, module.__doc__)
    vars(copy).update(vars(module), **replaced)
    return copy


# What a domain module's global is (by identity) -> what it becomes.
_REPLACEMENTS: dict[int, tuple[Any, Any]] = {
    id(real): (real, stand_in)
    for real, stand_in in (
        (datetime, _module_copy(datetime, datetime=_Datetime, date=_Date)),
        (datetime.datetime, _Datetime),
        (datetime.date, _Date),
        (time, _module_copy(time, time=_time, time_ns=_time_ns)),
        (time.time, _time),
        (time.time_ns, _time_ns),
    )
}
# sys.modules' size and last module at the last scan. An import since adds a module at its end
# (a dict: insertion order), so the two differ unless that import was undone, and the module held
# here cannot be freed for another to take its id. A scan takes ~1 ms with torch imported (4,000
# modules), 400 times the scope's own cost; modules are rarely imported once domains are loaded.
_seen: tuple[int, Any] = (0, None)


def _patch_domain_modules() -> None:
    """Point the clock names of every domain module at the stand-ins (again for a module
    already patched: nothing of it is real any more)."""
    global _seen
    size, last = len(sys.modules), sys.modules.get(next(reversed(sys.modules)))
    if size == _seen[0] and last is _seen[1]:
        return
    _seen = size, last
    prefix = DOMAIN_PACKAGE + "."
    for name, module in sys.modules.copy().items():
        if not name.startswith(prefix) or module is None:
            continue
        namespace = vars(module)
        for key, value in list(namespace.items()):
            replacement = _REPLACEMENTS.get(id(value))
            if replacement is not None and replacement[0] is value:
                namespace[key] = replacement[1]


@contextlib.contextmanager
def domain_clock(instant: datetime.datetime = INSTANT) -> Iterator[None]:
    """Run the body with the domain modules' clock frozen at ``instant`` (naive UTC) in this
    context (this thread, or this asyncio task) only."""
    _patch_domain_modules()
    token = _instant.set(instant)
    try:
        yield
    finally:
        _instant.reset(token)
