"""Serve a :class:`Toolbox` over HTTP, so episodes elsewhere reach these tools as
``endpoint:`` declarations (:class:`~nemo_orch.tools.remote.RemoteTool`).

Routes: ``GET /tools`` (the schemas), ``POST /tools/<name>`` (one call; the body is
``{"arguments", "context"}``, the answer a :class:`ToolResult` as JSON, failures included) and
``GET /health``. Calls run on one asyncio loop in a background thread, so the toolbox's
concurrency bounds, timeouts and cache hold across all clients.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from nemo_orch.serve.http_server import RequestError, ServerHandle, serve_json
from nemo_orch.tools.registry import Toolbox
from nemo_orch.tools.remote import context_from_json


class ToolServerHandle:
    """The HTTP server plus the loop that runs the tools; closing stops both."""

    def __init__(self, http: ServerHandle, toolbox: Toolbox, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread) -> None:
        self.http, self.toolbox, self._loop, self._thread = http, toolbox, loop, thread
        self.url = http.url

    def tool_url(self, name: str) -> str:
        return f"{self.url}/tools/{name}"

    def wait(self) -> None:
        self.http.wait()

    def close(self) -> None:
        self.http.close()
        asyncio.run_coroutine_threadsafe(self.toolbox.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "ToolServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_tool_server(toolbox: Toolbox, host: str = "127.0.0.1", port: int = 0, *,
                      api_key: str | None = None) -> ToolServerHandle:
    """Start the tools (warm-up) and serve them; ``port=0`` picks a free port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="tool-server-loop", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(toolbox.start(), loop).result()

    def call(name: str):
        def route(body: dict[str, Any]) -> dict[str, Any]:
            arguments = body.get("arguments")
            if not isinstance(arguments, dict):
                raise RequestError("'arguments' must be a JSON object")
            context = body.get("context") or {}
            if not isinstance(context, dict):
                raise RequestError("'context' must be a JSON object")
            future = asyncio.run_coroutine_threadsafe(
                toolbox.call(name, arguments, context_from_json(context)), loop)
            return future.result().to_json()
        return route

    routes = {("GET", "/tools"): lambda _: {"tools": toolbox.schemas()}}
    routes.update({("POST", f"/tools/{name}"): call(name) for name in toolbox.tools})
    http = serve_json(routes, host, port, api_key=api_key, name="tool-server")
    return ToolServerHandle(http, toolbox, loop, thread)
