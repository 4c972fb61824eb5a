"""A SIMULATED Tavily endpoint for tests: a real HTTP server on 127.0.0.1 speaking Tavily's
``/search`` protocol (Tavily itself cannot be reached offline)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from support.local_http import Answer, JSONServer


class SimulatedTavily:
    """Answers like Tavily's /search: responses are taken from ``script`` in order (status, body,
    headers), then 200 with ``respond(query)``; an Authorization header other than ``key``'s
    gets 401 whatever the script says."""

    def __init__(self, key: str, respond: Callable[[str], dict[str, Any]]) -> None:
        self.script: list[tuple[int, Any, dict[str, str]]] = []
        self.requests: list[dict[str, Any]] = []
        self.hang = False
        self.release = threading.Event()

        def answer(path: str, headers: Mapping[str, str], body: Any) -> Answer:
            self.requests.append({"path": path, "body": body, "auth": headers.get("Authorization")})
            if self.hang:
                self.release.wait(10)
                return None
            if headers.get("Authorization") != f"Bearer {key}":
                return 401, {"detail": {"error": "Unauthorized"}}, {}
            if self.script:
                return self.script.pop(0)
            return 200, respond(body["query"]), {}

        self._server = JSONServer(answer)
        self.url = self._server.url

    def stop(self) -> None:
        self.release.set()
        self._server.stop()
