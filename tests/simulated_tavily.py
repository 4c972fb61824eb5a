"""A SIMULATED Tavily endpoint for tests: a real HTTP server on 127.0.0.1 speaking Tavily's
``/search`` protocol (Tavily itself cannot be reached offline)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class SimulatedTavily:
    """Answers like Tavily's /search: responses are taken from ``script`` in order (status, body,
    headers), then 200 with ``respond(query)``; an Authorization header other than ``key``'s
    gets 401 whatever the script says."""

    def __init__(self, key: str, respond: Callable[[str], dict[str, Any]]) -> None:
        self.script: list[tuple[int, Any, dict[str, str]]] = []
        self.requests: list[dict[str, Any]] = []
        self.hang = False
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, "body": body,
                                      "auth": self.headers.get("Authorization")})
                if fake.hang:
                    fake.release.wait(10)
                    return
                if self.headers.get("Authorization") != f"Bearer {key}":
                    status, payload, headers = 401, {"detail": {"error": "Unauthorized"}}, {}
                elif fake.script:
                    status, payload, headers = fake.script.pop(0)
                else:
                    status, payload, headers = 200, respond(body["query"]), {}
                data = payload.encode() if isinstance(payload, str) else json.dumps(
                    payload).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
