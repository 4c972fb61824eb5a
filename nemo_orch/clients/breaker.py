"""Per endpoint: a circuit breaker and a retry budget, so a dead endpoint costs one fast failure
per call instead of every call's timeouts and retries, and a flaky one is not hammered by
retries.

* **Circuit breaker**: ``failures`` requests in a row that fail for good (their retries spent:
  no answer, a timeout, 5xx or 429) *open* the circuit: for ``cooldown_s`` every request fails
  at once, without being sent. Then one request is let through as a probe (the circuit is
  *half open*; the others still fail at once): if the endpoint answers, the circuit closes and
  requests flow again, whatever happened before; if not, it opens for another cool-down.
* **Retry budget**: retries may add at most ``retry_ratio`` of the requests made (with a reserve
  of ``retry_reserve`` retries for a start or a quiet spell): past it a failed attempt fails
  its request at once rather than retry.

Any answer the server gives (a success, or a refusal such as 400 that retrying would not change)
counts as the endpoint being up. A guard is shared by every event loop its client runs on.
:data:`UNGUARDED` turns both off: for an endpoint a run cannot go on without (GRPO's reward
server), whose requests wait out a restart within their retries, as configured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class GuardSettings:
    """See the module docstring. ``failures`` 0 turns the circuit breaker off, ``retry_ratio``
    None the retry budget."""

    failures: int = 5
    cooldown_s: float = 30.0
    retry_ratio: float | None = 0.2
    retry_reserve: float = 10.0

    def __post_init__(self) -> None:
        if (
            self.failures < 0
            or self.cooldown_s < 0
            or self.retry_reserve < 0
            or (self.retry_ratio is not None and self.retry_ratio < 0)
        ):
            raise ValueError(
                "an endpoint guard needs failures >= 0, cooldown_s >= 0, "
                "retry_ratio >= 0 (or None) and retry_reserve >= 0"
            )


UNGUARDED = GuardSettings(failures=0, retry_ratio=None)


class EndpointGuard:
    """One endpoint's circuit breaker and retry budget (``clock``: monotonic seconds)."""

    def __init__(
        self, settings: GuardSettings = GuardSettings(), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings, self._clock = settings, clock
        self._lock = threading.Lock()
        self._failures = 0
        self._last_problem = ""
        self._opened_at: float | None = None
        self._probing = False
        self._retry_balance = settings.retry_reserve
        # The most the balance may hold: a long quiet spell does not buy a retry storm.
        self._retry_cap = settings.retry_reserve + 100 * (settings.retry_ratio or 0.0)

    @property
    def is_open(self) -> bool:
        """Whether requests fail at once now (open, or half open with its probe out)."""
        with self._lock:
            return self._opened_at is not None and (
                self._probing or self._clock() < self._opened_at + self.settings.cooldown_s
            )

    def admit(self) -> str | None:
        """Why a request may not go now (None: it may; after a cool-down it goes as the
        probe). Each admitted request ends with :meth:`answered`, :meth:`failed` or
        :meth:`abandoned`."""
        with self._lock:
            if self.settings.retry_ratio is not None:
                self._retry_balance = min(
                    self._retry_cap, self._retry_balance + self.settings.retry_ratio
                )
            if self._opened_at is None:
                return None
            waited = self._clock() - self._opened_at
            if waited < self.settings.cooldown_s:
                return (
                    f"circuit open after {self._failures} failed requests in a row (last: "
                    f"{self._last_problem}); tried again in "
                    f"{self.settings.cooldown_s - waited:.1f} s"
                )
            if self._probing:
                return (
                    f"circuit half open after {self._failures} failed requests in a row "
                    f"(last: {self._last_problem}); a probe request is out"
                )
            self._probing = True
            return None

    def answered(self) -> None:
        """The endpoint answered: the circuit closes."""
        with self._lock:
            self._failures, self._opened_at, self._probing = 0, None, False

    def failed(self, problem: str) -> None:
        """A request failed for good (``problem``: why, in one line)."""
        with self._lock:
            self._failures += 1
            self._last_problem = problem
            if self.settings.failures and (
                self._probing or self._failures >= self.settings.failures
            ):
                self._opened_at = self._clock()
            self._probing = False

    def abandoned(self) -> None:
        """A request ended without a verdict on the endpoint (cancelled): a probe is freed."""
        with self._lock:
            self._probing = False

    def may_retry(self) -> bool:
        """Whether the retry budget allows one more retry now (taking it if so)."""
        if self.settings.retry_ratio is None:
            return True
        with self._lock:
            if self._retry_balance < 1:
                return False
            self._retry_balance -= 1
            return True
