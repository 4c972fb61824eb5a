"""A stdlib JSON server on 127.0.0.1, in a daemon thread: what the tests' SIMULATED services
(Tavily, OpenAI) and fault-injecting stubs answer with."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# (status, payload: JSON-able or a str sent as is, extra headers), or None: no reply at all.
Answer = tuple[int, Any, Mapping[str, str]] | None


class JSONServer:
    """Answers every POST with ``answer(path, headers, body)`` (the body decoded from JSON; the
    reply JSON unless its headers name another ``Content-Type``);
    ``url`` is ``http://127.0.0.1:PORT`` plus ``url_path``. A context manager, or ``stop()``."""

    def __init__(
        self, answer: Callable[[str, Mapping[str, str], Any], Answer], url_path: str = ""
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                answered = answer(self.path, self.headers, body)
                if answered is None:
                    return
                status, payload, headers = answered
                data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Type" not in headers:  # e.g. text/event-stream for a stream
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}{url_path}"
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> JSONServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
