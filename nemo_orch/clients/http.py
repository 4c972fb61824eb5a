"""JSON over HTTP with the project's rules for external calls: a timeout on every request (and
a bound of its own on connecting), a bounded retry with exponential backoff (and jitter) on
connection errors, timeouts, 408, 429 and 5xx, an immediate clear error on other 4xx, a circuit
breaker and a retry budget per endpoint (:mod:`nemo_orch.clients.breaker`), and an API key read
from the environment that never appears in logs, reprs or errors. Every failure has its
:class:`~nemo_orch.call_kinds.CallKind` (:attr:`HTTPError.kind`).

Used by every client the project has: OpenAI-compatible servers, Tavily web search and remote
tool endpoints; each request goes through the call store where ``calls.mode`` records or replays
(:mod:`nemo_orch.clients.call_store`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from nemo_orch.call_kinds import CallKind
from nemo_orch.clients import call_store
from nemo_orch.clients.breaker import EndpointGuard, GuardSettings
from nemo_orch.clients.sse import event_data

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Refusals of what a request carried (its parameters, its size, its content): the same endpoint
# takes other requests. Any other 4xx (401, 403, 404, ...) refuses every request alike.
REFUSAL_STATUSES = frozenset({400, 413, 422})


class HTTPError(RuntimeError):
    """A request that failed for good; ``status`` is the HTTP status (None: no response)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def kind(self) -> CallKind:
        """``refused`` for a request refused for what it carried (:data:`REFUSAL_STATUSES`);
        ``infra_error`` for the rest: no answer, a timeout, 5xx or 429 after the retries, an
        open circuit, an endpoint that refuses every request (401, 403, 404), a reply that is
        not what the protocol answers."""
        return CallKind.REFUSED if self.status in REFUSAL_STATUSES else CallKind.INFRA_ERROR


# The exception line of a Python traceback: ``package.module.SomeError: message``.
_EXCEPTION_LINE = re.compile(
    r"^[A-Za-z_][\w.]*(?:Error|Exception): (?!Traceback)(.+)$", re.MULTILINE
)


def error_message(response: httpx.Response) -> str:
    """The server's error message (``{"error": {"message"}}``, ``{"detail"}`` or raw text),
    shortened. A message carrying a server-side Python traceback (what Triton answers for a
    Python-backend model that raises; nemo-orch's servers send one line) is cut to the innermost
    exception's message."""
    try:
        body = response.json()
        error = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
        message = error.get("message", error) if isinstance(error, dict) else error
        text = str(message)
    except ValueError:
        text = response.text
    if "Traceback (most recent call last)" in text:
        raised = _EXCEPTION_LINE.findall(text)
        text = raised[-1] if raised else text
    return text[:500]


class JSONClient:
    """Async JSON client of one server (``base_url``).

    ``api_key_env`` names the environment variable holding the key, sent as
    ``Authorization: Bearer``; it is read at the first request, so an unset variable is an error
    of that request (naming the variable), not of construction. Usable from several event loops
    in turn (each gets its own connection pool), so sync callers may use ``asyncio.run``.
    ``error_type`` is the exception raised (a subclass of :class:`HTTPError`).
    ``max_in_flight`` bounds the requests sent at once (per event loop; the others wait their
    turn): how an evaluation keeps a bound per endpoint. ``retry_also`` names more refusals to
    retry (e.g. a server up but still loading what it serves).
    ``connect_timeout_s`` bounds connecting, apart from ``timeout_s`` (a slow model's long
    replies need not make an unreachable host slow to fail); ``guard`` is the endpoint's
    circuit breaker and retry budget (:mod:`nemo_orch.clients.breaker`).
    """

    error_type: type[HTTPError] = HTTPError
    retry_also: Callable[[httpx.Response], bool] = staticmethod(lambda response: False)

    def __init__(
        self,
        base_url: str,
        *,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        seed: int | None = None,
        max_in_flight: int | None = None,
        connect_timeout_s: float = 10.0,
        guard: GuardSettings = GuardSettings(),
    ) -> None:
        if (
            max_retries < 0
            or timeout_s <= 0
            or connect_timeout_s <= 0
            or backoff_s < 0
            or max_backoff_s < backoff_s
        ):
            raise ValueError(
                "need max_retries >= 0, timeout_s > 0, connect_timeout_s > 0 and "
                "0 <= backoff_s <= max_backoff_s"
            )
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be None or >= 1")
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.max_retries = max_retries
        self.guard = EndpointGuard(guard)
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._rng = random.Random(seed)
        self._api_key: str | None = None
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self.max_in_flight = max_in_flight
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def _key(self) -> str | None:
        if self.api_key_env is None:
            return None
        if self._api_key is None:
            key = os.environ.get(self.api_key_env, "").strip()
            if not key:
                raise self.error_type(
                    f"environment variable {self.api_key_env} (the API key of "
                    f"{self.base_url}) is not set",
                    None,
                )
            self._api_key = key
        return self._api_key

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        for other in [old for old in self._clients if old.is_closed()]:
            del self._clients[other]  # its connections died with their loop
        if loop not in self._clients:
            key = self._key()
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            timeout = httpx.Timeout(
                self.timeout_s, connect=min(self.connect_timeout_s, self.timeout_s)
            )
            self._clients[loop] = httpx.AsyncClient(
                base_url=self.base_url, headers=headers, timeout=timeout
            )
        return self._clients[loop]

    async def aclose(self) -> None:
        """Close this loop's connection pool."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def __aenter__(self) -> JSONClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def scrub(self, text: str) -> str:
        """``text`` without the key (servers sometimes echo it in errors)."""
        return text.replace(self._api_key, "[redacted]") if self._api_key else text

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after is not None:
            try:
                return min(max(0.0, float(retry_after)), self.max_backoff_s)
            except ValueError:
                pass
        delay = min(self.backoff_s * 2**attempt, self.max_backoff_s)
        return delay / 2 + self._rng.uniform(0, delay / 2)

    async def request(
        self, method: str, path: str, payload: Mapping[str, Any] | None = None
    ) -> Any:
        """One JSON request under the retry policy; the decoded JSON body on success (a reply
        streamed as server-sent events: its events' data, an
        :class:`~nemo_orch.clients.sse.EventStream`)."""
        if self.max_in_flight is None:
            return await self._request(method, path, payload)
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots = {old: slots for old, slots in self._slots.items() if not old.is_closed()}
            self._slots[loop] = asyncio.Semaphore(self.max_in_flight)
        async with self._slots[loop]:
            return await self._request(method, path, payload)

    def refusal(
        self, response: httpx.Response, payload: Mapping[str, Any] | None
    ) -> Exception | None:
        """What to raise, in place of :attr:`error_type`, when the server refuses ``payload``
        for good (None: :attr:`error_type`): a client whose requests follow a configuration
        names it here."""
        return None

    async def _request(self, method: str, path: str, payload: Mapping[str, Any] | None) -> Any:
        """One request, through the process's call store where one records or replays
        (:mod:`nemo_orch.clients.call_store`): a call it must replay but does not hold fails as
        an infrastructure error."""
        url = f"{self.base_url}/{path.lstrip('/')}"
        recording = call_store.active()
        if recording is None:
            return await self._guarded(method, path, url, payload)
        try:
            return await recording.call(
                method, url, payload, lambda: self._guarded(method, path, url, payload)
            )
        except call_store.StoreMiss as miss:
            raise self.error_type(self.scrub(str(miss)), None) from None

    async def _guarded(
        self, method: str, path: str, url: str, payload: Mapping[str, Any] | None
    ) -> Any:
        """One request under the endpoint's guard: refused at once while its circuit is open;
        its end (an answer, a failure for good, neither) reported to the guard."""
        closed = self.guard.admit()
        if closed is not None:
            raise self.error_type(self.scrub(f"{method} {url} not sent: {closed}"), None)
        try:
            body = await self._attempts(method, path, url, payload)
        except HTTPError as error:
            if error.status is None or error.status in RETRY_STATUSES:
                self.guard.failed(str(error)[:300])
            else:  # the server answered, if with a refusal or a body that is not JSON
                self.guard.answered()
            raise
        except BaseException:
            self.guard.abandoned()
            raise
        self.guard.answered()
        return body

    async def _attempts(
        self, method: str, path: str, url: str, payload: Mapping[str, Any] | None
    ) -> Any:
        client = self._client()
        for attempt in range(self.max_retries + 1):
            response = None
            try:
                async with asyncio.timeout(self.timeout_s):
                    response = await client.request(method, path.lstrip("/"), json=payload)
            except (TimeoutError, httpx.TimeoutException) as error:
                problem = (
                    f"no connection within {self.connect_timeout_s:g} s"
                    if isinstance(error, httpx.ConnectTimeout)
                    else f"timed out after {self.timeout_s:g} s"
                )
            except httpx.TransportError as error:  # connect errors, dropped connections
                problem = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 400:
                    if response.headers.get("content-type", "").startswith("text/event-stream"):
                        return event_data(response.text)
                    try:
                        return response.json()
                    except ValueError:
                        raise self.error_type(
                            f"{method} {url}: response is not JSON", response.status_code
                        ) from None
                problem = f"HTTP {response.status_code}: {error_message(response)}"
                if response.status_code not in RETRY_STATUSES and not self.retry_also(response):
                    raise self.refusal(response, payload) or self.error_type(
                        self.scrub(f"{method} {url} failed with {problem}"), response.status_code
                    )
            status = response.status_code if response is not None else None
            attempts = f"{attempt + 1} attempt{'s' * bool(attempt)}"
            if attempt == self.max_retries:
                raise self.error_type(
                    self.scrub(f"{method} {url} failed after {attempts}; last error: {problem}"),
                    status,
                )
            if self.guard.is_open or not self.guard.may_retry():
                why = (
                    "its circuit opened meanwhile"
                    if self.guard.is_open
                    else "the endpoint's retry budget is spent"
                )
                raise self.error_type(
                    self.scrub(
                        f"{method} {url} failed after {attempts}, not retried: {why}; "
                        f"last error: {problem}"
                    ),
                    status,
                )
            delay = self._delay(attempt, response)
            log.warning(
                "%s %s: %s; retry %d/%d in %.2f s",
                method,
                url,
                self.scrub(problem),
                attempt + 1,
                self.max_retries,
                delay,
            )
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")
