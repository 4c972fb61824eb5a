"""MCP servers as tool sources (``tools.mcp``): each server's tools join the toolbox as tools of
their own, through the official ``mcp`` SDK.

A server is listed when the toolbox is built (``tools/list``, on a connection of its own), so
its tools are declared like any other: named ``<server>_<tool>``, described by their own
descriptions and input schemas, priced per call (``prices``, ``per_call_usd``). When the
toolbox starts, the server is connected once for all its tools (a stdio server is started
then, and stopped with the toolbox), within ``connect_timeout_s``; a call is ``tools/call``
within ``timeout_s``. Text content becomes the observation (structured content as JSON when
there is no text); content that is not text (an image, audio, a resource without text) is
described by its type and size, and a result with nothing else is ``empty``
(:mod:`nemo_orch.call_kinds`). An ``isError`` result is the tool's ``tool_error``; a timeout and
a failed transport are ``infra_error``. A call whose connection is gone reconnects once, with
the toolbox's bounds on concurrency and time. Failed or lost connections in a row beyond
``restarts`` open the server's circuit (:mod:`nemo_orch.clients.breaker`): for ``cooldown_s``
its tools' calls fail at once, then it is connected again; a server that came back is used
again, whatever happened before.

A server that sends ``notifications/tools/list_changed`` is marked changed; the toolbox lists
it again at its next :meth:`~nemo_orch.tools.registry.Toolbox.refresh` (between episodes),
so its new tools are offered, and its dropped ones not, from the next episode on.

A server declared ``orchestrator: true`` is another orchestrator (``nemo-orch serve mcp``):
its results' structured content is an orchestration, whose ledger is billed to the call and
whose episode is kept with it (:func:`~nemo_orch.tools.orchestrator.sub_orchestration_result`).
Declared, not detected: what a result is billed is the operator's decision about a server
they run, never a claim any server can make by returning a ``ledger`` key; and a declared
orchestrator whose result lacks a ledger is an error rather than a call silently billed at
nothing.

The connection lives in a task of its own: the SDK's transports are AnyIO context managers,
which must be entered and left by the same task, while calls come from every episode's.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import os
import re
import time
from datetime import timedelta
from typing import Any

from nemo_orch.call_kinds import CallKind
from nemo_orch.clients import call_store
from nemo_orch.clients.breaker import EndpointGuard, GuardSettings
from nemo_orch.config import McpServerConfig
from nemo_orch.loop_thread import LoopThread
from nemo_orch.tools.base import (
    BaseTool,
    Pricing,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    billed_result,
)
from nemo_orch.tools.orchestrator import SEED_META, failure_kind, sub_orchestration_result, sub_seed


def failure(error: BaseException) -> str:
    """What went wrong, in one line: the SDK's AnyIO task groups wrap the cause in exception
    groups, whose own message ("unhandled errors in a TaskGroup") names none."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(dict.fromkeys(failure(inner) for inner in error.exceptions))
    message = str(error).replace("\n", " ")
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class McpServer:
    """One MCP server: its connection (:meth:`connect` / :meth:`close`, shared by its tools) and
    its requests."""

    def __init__(self, config: McpServerConfig) -> None:
        self.config = config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        # Set by the server's list_changed notification, cleared by listing it again.
        self.tools_changed = False
        # A connection ended other than by close(): the next connect is a restart.
        self._lost = False
        self.restarts = 0  # connections made again, in all
        # Failed or lost connections in a row: the first opens the circuit, and each restart
        # adds one more before it does.
        self.guard = EndpointGuard(
            GuardSettings(
                failures=config.restarts + 1, cooldown_s=config.cooldown_s, retry_ratio=None
            )
        )

    def _on_this_loop(self) -> None:
        """A connection belongs to the event loop that made it: a toolbox started again on
        another loop (a test, a new evaluation) connects anew."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._session, self._stop, self._task = loop, None, None, None
            self._lock = asyncio.Lock()

    def _transport(self) -> Any:
        """The SDK's transport for the server, its secrets read from the environment here."""
        if self.config.command is not None:
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            return stdio_client(
                StdioServerParameters(
                    command=self.config.command,
                    args=list(self.config.args),
                    env={name: os.environ[name] for name in self.config.env if name in os.environ},
                )
            )
        from mcp.client.streamable_http import streamablehttp_client

        missing = [
            variable for variable in self.config.headers.values() if variable not in os.environ
        ]
        if missing:
            raise ToolError(
                f"tools.mcp.{self.config.name}: the environment has no "
                f"{', '.join(missing)} (its headers' values)"
            )
        headers = {header: os.environ[variable] for header, variable in self.config.headers.items()}
        return streamablehttp_client(
            self.config.url,
            headers=headers,
            timeout=self.config.connect_timeout_s,
            sse_read_timeout=self.config.timeout_s,
        )

    async def _on_message(self, message: Any) -> None:
        """The session's messages from the server: a changed tool list is noted (listing it
        here would wait on the very loop that reads the reply)."""
        from mcp.types import ServerNotification, ToolListChangedNotification

        if isinstance(message, ServerNotification) and isinstance(
            message.root, ToolListChangedNotification
        ):
            self.tools_changed = True

    async def _serve(self, ready: asyncio.Future) -> None:
        from mcp import ClientSession

        stop, connected = self._stop, False
        try:
            async with (
                self._transport() as (read, write, *_),
                ClientSession(read, write, message_handler=self._on_message) as session,
            ):
                await session.initialize()
                self._session = session
                ready.set_result(None)
                connected = True
                await stop.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_exception(
                    ToolError(f"tools.mcp.{self.config.name}: the connection was cancelled")
                )
            raise
        except Exception as error:  # whoever waits to connect is told; later, the next call is
            if not ready.done():
                ready.set_exception(error)
        finally:
            self._session = None
            if connected and not stop.is_set():
                self._lost = True

    async def connect(self) -> None:
        """Connect (a stdio server: start it), once, within ``connect_timeout_s``; raises
        :class:`ToolError` on failure, and at once while the server's circuit is open."""
        self._on_this_loop()
        async with self._lock:
            if self._session is not None:
                return
            await self._disconnect()
            closed = self.guard.admit()
            if closed is not None:
                raise ToolError(f"tools.mcp.{self.config.name}: not connected: {closed}")
            if self._lost:
                self.restarts += 1
            self._stop = asyncio.Event()
            ready = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._serve(ready))
            try:
                await asyncio.wait_for(ready, self.config.connect_timeout_s)
            except Exception as error:
                await self._disconnect()
                problem = (
                    f"no connection within {self.config.connect_timeout_s:g} s (connect_timeout_s)"
                    if isinstance(error, TimeoutError)
                    else failure(error)
                )
                self.guard.failed(problem)
                raise ToolError(
                    f"tools.mcp.{self.config.name}: cannot connect: {problem}"
                ) from None
            except BaseException:
                self.guard.abandoned()
                raise
            self._lost = False

    async def _disconnect(self) -> None:
        if self._task is not None:
            self._stop.set()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._task, self.config.timeout_s)
            self._task = None

    async def close(self) -> None:
        self._on_this_loop()
        async with self._lock:
            await self._disconnect()

    async def list_tools(self) -> list[Any]:
        """``tools/list``; a list_changed notification from now on marks it changed again."""
        await self.connect()
        self.tools_changed = False
        return list((await self._session.list_tools()).tools)

    async def call(
        self, tool: str, arguments: dict[str, Any], meta: dict[str, Any] | None = None
    ) -> Any:
        """``tools/call`` (``meta``: the request's ``_meta``). A connection found closed
        before the request went out (a server that died since) is made again, once; one that
        closes during the call fails the call, and the next call reconnects (the request may
        have run: it is not repeated). A call the server answers closes its circuit."""
        import anyio
        from mcp.shared.exceptions import McpError
        from mcp.types import CONNECTION_CLOSED

        for attempt in (0, 1):
            await self.connect()
            session = self._session
            try:
                result = await self._while_connected(
                    session.call_tool(
                        tool,
                        arguments,
                        read_timeout_seconds=timedelta(seconds=self.config.timeout_s),
                        meta=meta,
                    )
                )
            except (anyio.ClosedResourceError, anyio.BrokenResourceError) as error:
                await self._drop(session, error)
                if attempt:
                    raise
            except ConnectionError as error:  # it ended during the call, which is not repeated
                await self._drop(session, error)
                raise
            except McpError as error:
                if error.error.code == CONNECTION_CLOSED:
                    await self._drop(session, error)
                raise
            else:
                self.guard.answered()
                return result
        raise AssertionError("unreachable")

    async def _while_connected(self, request: Any) -> Any:
        """What ``request`` (a coroutine on the session) returns; a :class:`ConnectionError` as
        soon as the connection ends meanwhile: a transport that failed (an HTTP server gone)
        does not tell the requests waiting on it, which would wait out their timeouts."""
        serving, answer = self._task, asyncio.ensure_future(request)
        try:
            done, _ = await asyncio.wait({answer, serving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not answer.done():
                answer.cancel()
                await asyncio.gather(answer, return_exceptions=True)
        if answer in done:
            return answer.result()
        raise ConnectionError("the connection ended while the call waited for its answer")

    async def _drop(self, session: Any, error: BaseException) -> None:
        """Close the connection ``session`` belongs to, found lost (by ``error``), unless
        another replaced it."""
        async with self._lock:
            if self._session in (session, None):  # None: its task saw the end first
                self._lost = True
                self.guard.failed(f"connection lost: {failure(error)}")
                await self._disconnect()


class McpTool(BaseTool):
    """One tool of an :class:`McpServer`, as the policy is offered it."""

    def __init__(self, spec: ToolSpec, server: McpServer, remote_name: str) -> None:
        super().__init__(spec)
        self.server, self.remote_name = server, remote_name

    async def start(self) -> None:
        await self.server.connect()

    async def close(self) -> None:
        await self.server.close()

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        started = time.perf_counter()
        try:
            # A sub-orchestrator's episode gets its seed from the caller's call.
            meta = (
                {SEED_META: sub_seed(context, self.spec.name, arguments)}
                if self.server.config.orchestrator
                else None
            )
            # Through a call store where one records or replays (calls.*, a journal).
            result, took = await call_store.kept(
                "tools/call",
                f"mcp://{self.server.config.name}/{self.remote_name}",
                {"arguments": arguments, "meta": meta},
                lambda: self.server.call(self.remote_name, arguments, meta),
                lambda answer: answer.model_dump(mode="json", by_alias=True, exclude_none=True),
                _call_result,
            )
        except Exception as error:  # a failed transport or server, a replay's miss: its error
            return billed_result(
                self.spec,
                started,
                context,
                error=f"{self.spec.name} failed: {failure(error)}",
                kind=_kind_of_failure(error),
            )
        texts, others = read_content(result.content)
        text = "\n".join(texts)
        if not text and result.structuredContent is not None:
            text = json.dumps(result.structuredContent, ensure_ascii=False)
        if result.isError:  # a declared orchestrator states whether it failed or refused
            return billed_result(
                self.spec,
                started,
                context,
                error=text or f"{self.spec.name} reported an error",
                kind=(
                    failure_kind(text) if self.server.config.orchestrator else CallKind.TOOL_ERROR
                ),
                took=took,
            )
        if self.server.config.orchestrator:
            return sub_orchestration_result(
                self.spec, started, context, result.structuredContent, text
            )
        described = f"[{'; '.join(others)}]" if others else ""
        if not text:
            return billed_result(
                self.spec,
                started,
                context,
                kind=CallKind.EMPTY,
                error=(f"{self.spec.name} returned no text: {described or 'no content at all'}"),
                took=took,
            )
        return billed_result(
            self.spec, started, context, f"{text}\n{described}" if described else text, took=took
        )


def _call_result(stored: dict[str, Any]) -> Any:
    """A ``tools/call`` result as a call store kept it."""
    from mcp.types import CallToolResult

    return CallToolResult.model_validate(stored)


def _kind_of_failure(error: Exception) -> CallKind:
    """A call the server refused for its arguments (JSON-RPC's invalid params) is ``refused``;
    any other failure (no connection, a timeout, the server's own error) ``infra_error``."""
    from mcp.shared.exceptions import McpError
    from mcp.types import INVALID_PARAMS

    if isinstance(error, McpError) and error.error.code == INVALID_PARAMS:
        return CallKind.REFUSED
    return CallKind.INFRA_ERROR


def read_content(content: list[Any]) -> tuple[list[str], list[str]]:
    """A result's content parts: the texts (text parts, embedded text resources) and a
    description of each other part, by its type and size (``image image/png, 2,048 bytes``):
    what a text-reading policy is told of what it cannot read."""
    texts, others = [], []
    for item in content:
        kind = getattr(item, "type", "?")
        if kind == "text":
            texts.append(item.text)
        elif kind == "resource" and isinstance(getattr(item.resource, "text", None), str):
            texts.append(item.resource.text)
        elif kind == "resource":
            others.append(
                f"resource {item.resource.uri} ({_mime(item.resource)}"
                f"{_size(getattr(item.resource, 'blob', None))})"
            )
        elif kind == "resource_link":
            size = "" if item.size is None else f", {item.size:,} bytes"
            others.append(f"resource link {item.uri} ({_mime(item)}{size})")
        else:  # image, audio, and any kind a later protocol version adds
            others.append(f"{kind} ({_mime(item)}{_size(getattr(item, 'data', None))})")
    return texts, others


def _mime(item: Any) -> str:
    return getattr(item, "mimeType", None) or "no MIME type"


def _size(data: Any) -> str:
    """The decoded size of base64 ``data`` (empty where there is none)."""
    if not isinstance(data, str):
        return ""
    try:
        return f", {len(base64.b64decode(data, validate=True)):,} bytes"
    except (binascii.Error, ValueError):
        return f", {len(data):,} characters of data that is not base64"


def tool_name(server: str, tool: str) -> str:
    """The toolbox's name of the tool ``tool`` of the server named ``server`` (``get-weather``
    of ``wx``: ``wx_get_weather``)."""
    return server + "_" + re.sub(r"\W", "_", tool)


def _taken(config: McpServerConfig, listed: list[Any]) -> list[Any]:
    """The listed tools the configuration takes: allowed and not denied."""
    return [
        tool
        for tool in listed
        if (config.allow is None or tool.name in config.allow) and tool.name not in config.deny
    ]


class McpToolSource:
    """A server's tools as the toolbox offers them (a
    :class:`~nemo_orch.tools.base.ToolSource`): listed by :func:`mcp_source`, again by
    :meth:`relist` once the server said they changed."""

    def __init__(self, config: McpServerConfig, listed: list[Any]) -> None:
        self.name, self.config, self.server = config.name, config, McpServer(config)
        self.tools = self._tools(listed)

    def _tools(self, listed: list[Any]) -> list[McpTool]:
        config = self.config
        return [
            McpTool(
                ToolSpec(
                    name=tool_name(config.name, tool.name),
                    description=tool.description or tool.name,
                    parameters={"type": "object", **(tool.inputSchema or {})},
                    pricing=Pricing(per_call=config.prices.get(tool.name, config.per_call_usd)),
                    latency_hint_s=config.latencies.get(tool.name, config.latency_hint_s),
                    timeout_s=config.timeout_s,
                ),
                self.server,
                tool.name,
            )
            for tool in _taken(config, listed)
        ]

    @property
    def changed(self) -> bool:
        return self.server.tools_changed

    async def relist(self) -> None:
        self.tools = self._tools(await self.server.list_tools())

    async def start(self) -> None:
        await self.server.connect()

    async def close(self) -> None:
        await self.server.close()


def mcp_source(config: McpServerConfig) -> McpToolSource:
    """The tools ``config``'s server lists, as the toolbox's (allowed and not denied), from a
    connection of their own made here; raises :class:`ToolError` when the server cannot be
    reached or lists none of the allowed tools."""

    async def listed() -> list[Any]:
        server = McpServer(config)
        try:
            return await server.list_tools()
        finally:
            await server.close()

    loop = LoopThread(f"mcp-{config.name}")
    try:
        remote = loop.run(listed())
    finally:
        loop.stop()
    if not _taken(config, remote):
        raise ToolError(
            f"tools.mcp.{config.name}: no tool taken of the {len(remote)} it lists "
            f"({', '.join(tool.name for tool in remote)})"
        )
    return McpToolSource(config, remote)
