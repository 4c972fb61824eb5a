"""A small JSON-over-HTTP server for the project's endpoints (OpenAI-compatible generation,
tools), on the standard library's ``ThreadingHTTPServer``: no web framework dependency.

Routes map ``(method, path)`` to a function of the decoded JSON body returning a JSON-able dict,
or an :class:`EventStream`; a path's ``{name}`` segment matches any one segment, passed to the
route as the keyword argument ``name`` (``/sessions/{session}/v1/models``): server-sent events in OpenAI's streaming format, sent with chunked
transfer encoding so that the connection stays open for the client's next request.
A :class:`RequestError` becomes its status with an OpenAI-style error body; any other exception
a 500 with a generic message (details go to the log, not to the client). Once a stream has
started, its status is sent: an exception then becomes an error event (the ``openai`` client
raises it as an ``APIError``) that ends the stream without ``[DONE]``, counted as a 500. With
``api_key``, every route but ``GET /health`` requires ``Authorization: Bearer <api_key>``. With
``metrics``, every answered request is counted and timed by route (4xx: ``bad_request``, 5xx:
``error``).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from nemo_orch.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class EventStream:
    """A route's answer sent as server-sent events: each of ``events`` as ``data: <JSON>``, then
    ``data: [DONE]``. Whatever can refuse the request should run before the route returns one:
    once streaming, the status (200) is sent."""

    events: Iterable[dict]


Route = Callable[..., dict | EventStream]


def _match(
    routes: Mapping[tuple[str, str], Route], method: str, path: str
) -> tuple[tuple[str, str], Route, dict[str, str]] | None:
    """The route of ``method path`` (an exact path first, then a pattern), its key and the
    values of its ``{name}`` segments; None when no route matches."""
    if (method, path) in routes:
        return (method, path), routes[(method, path)], {}
    segments = path.split("/")
    for (route_method, pattern), route in routes.items():
        parts = pattern.split("/")
        if route_method != method or len(parts) != len(segments) or "{" not in pattern:
            continue
        values = {}
        for part, segment in zip(parts, segments):
            if part.startswith("{") and part.endswith("}") and segment:
                values[part[1:-1]] = segment
            elif part != segment:
                break
        else:
            return (method, pattern), route, values
    return None


class RequestError(Exception):
    """A request the server refuses: answered with ``status`` and an OpenAI error body."""

    def __init__(
        self, message: str, status: int = 400, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _status(code: int) -> str:
    return "ok" if code < 400 else "bad_request" if code < 500 else "error"


def _error_body(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


INTERNAL_ERROR = _error_body("internal server error", "server_error", 500)


def _handler(
    routes: Mapping[tuple[str, str], Route], api_key: str | None, metrics: ServeMetrics | None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            started = time.perf_counter()
            path = self.path.split("?")[0].rstrip("/") or "/"
            matched = _match(routes, method, path)
            code = self._answer(method, matched)
            if metrics is not None:
                label = "unknown" if matched is None else matched[0][1]
                metrics.observe(
                    label,
                    _status(code),
                    time.perf_counter() - started,
                    None if code < 400 else str(code),
                )

        def _answer(
            self, method: str, matched: tuple[tuple[str, str], Route, dict[str, str]] | None
        ) -> int:
            """Answer the request; returns the status sent."""
            try:
                body = self._read_body() if method == "POST" else {}
                if matched is None:
                    raise RequestError(f"no route {method} {self.path}", 404, "not_found_error")
                key, route, values = matched
                if api_key is not None and key != ("GET", "/health"):
                    given = self.headers.get("Authorization", "")
                    if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                        raise RequestError("missing or wrong API key", 401, "authentication_error")
                answer = route(body, **values)
            except RequestError as error:
                return self._reply(error.status, _error_body(str(error), error.kind, error.status))
            except Exception:
                log.exception("%s %s failed", method, self.path)
                return self._reply(500, INTERNAL_ERROR)
            if isinstance(answer, EventStream):
                return self._stream(answer)
            return self._reply(200, answer)

        def _read_body(self) -> dict:
            try:
                length = int(self.headers.get("Content-Length", 0))
            except ValueError:
                raise RequestError("bad Content-Length") from None
            if length < 0:
                raise RequestError("bad Content-Length")
            if length > MAX_BODY_BYTES:
                raise RequestError(f"request body over {MAX_BODY_BYTES} bytes", 413)
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except ValueError as error:  # invalid UTF-8 too
                raise RequestError(f"the body is not valid JSON: {error}") from None
            except RecursionError:
                raise RequestError("the body's JSON nests too deeply") from None
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            return body

        def _reply(self, status: int, payload: dict) -> int:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            try:
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                self._client_left()
            return status

        def _stream(self, stream: EventStream) -> int:
            """Send ``stream`` as server-sent events; returns the status to count: 200, or 500
            when producing an event failed."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            status = 200
            try:
                self.end_headers()
                try:
                    for event in stream.events:
                        self._send_event(json.dumps(event))
                    self._send_event("[DONE]")
                except (BrokenPipeError, ConnectionResetError):
                    raise  # nothing more can be sent: below
                except Exception:
                    log.exception("%s %s failed while streaming", self.command, self.path)
                    self._send_event(json.dumps(INTERNAL_ERROR))
                    status = 500
                self.wfile.write(b"0\r\n\r\n")  # the chunked body's end
            except (BrokenPipeError, ConnectionResetError):  # the client gave up
                self._client_left()
            return status

        def _send_event(self, data: str) -> None:
            """One ``data:`` event as one HTTP chunk (written through: ``wfile`` is unbuffered)."""
            event = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))

        def _client_left(self) -> None:
            log.debug(
                "%s %s: the client closed the connection before the reply ended",
                self.command,
                self.path,
            )
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The default backlog (5) resets connections when many clients connect at once, e.g. an
    # evaluation's concurrent episodes.
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client may reset a kept-alive connection, e.g. the ``openai`` client closing a
        # stream it stopped reading at [DONE]: not a server error, so no traceback on stderr.
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("%s closed the connection", client_address)
            return
        super().handle_error(request, client_address)


class ServerHandle:
    """A running server; ``url`` is ``http://host:port`` plus the server's base path. Closing
    also stops its metrics export, if any."""

    def __init__(
        self,
        server: ThreadingHTTPServer,
        url_path: str,
        name: str,
        metrics: ServeMetrics | None = None,
    ) -> None:
        self._server = server
        self.metrics = metrics
        self.host, self.port = server.server_address[:2]
        self.url = f"http://{self.host}:{self.port}{url_path}"
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"{name}-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def wait(self) -> None:
        """Block until the server is closed (e.g. by Ctrl-C in a ``serve`` command)."""
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_json(
    routes: Mapping[tuple[str, str], Route],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    api_key: str | None = None,
    url_path: str = "",
    name: str = "json-server",
    metrics: ServeMetrics | None = None,
) -> ServerHandle:
    """Serve ``routes`` (plus ``GET /health``) in background threads; ``port=0``: a free port.
    ``metrics`` counts the requests (export them with ``metrics.serve``)."""
    routes = {("GET", "/health"): lambda _: {"status": "ok"}, **routes}
    server = _Server((host, port), _handler(routes, api_key, metrics))
    return ServerHandle(server, url_path, name, metrics)
