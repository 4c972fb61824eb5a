"""A real MCP server written with the SDK (FastMCP), for the tests: ``python tests/support/mcp_server.py
stdio`` or ``... http PORT``. Its tools add, fail (an error result), sleep (for timeouts),
whoami (the bearer token the HTTP client sent), die (exits the process: a crashed server),
reshape (adds the tool triple, removes sleep, and says the tool list changed), picture (an
image and no text) and captioned (a caption and an image). ``FIXTURE_START_DELAY`` seconds
pass before it serves (a slow start)."""

from __future__ import annotations

import base64
import os
import sys
import time

from mcp.server.fastmcp import Context, FastMCP, Image

server = FastMCP(
    "fixture",
    host="127.0.0.1",
    port=int(sys.argv[2]) if len(sys.argv) > 2 else 0,
    log_level="WARNING",
)


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(reason: str) -> str:
    """Always fails, saying why."""
    raise ValueError(reason)


@server.tool()
async def sleep(seconds: float) -> str:
    """Wait, then say so."""
    import asyncio

    await asyncio.sleep(seconds)
    return "slept"


@server.tool()
def whoami(ctx: Context) -> str:
    """The bearer token of the request (HTTP), or this server's FIXTURE_SECRET (stdio)."""
    request = ctx.request_context.request
    if request is None:
        return os.environ.get("FIXTURE_SECRET", "no secret")
    return request.headers.get("authorization", "no header")


@server.tool()
def die() -> str:
    """Ends the server's process."""
    os._exit(1)


def triple(n: int) -> int:
    """Three times an integer (offered once reshape ran)."""
    return 3 * n


@server.tool()
async def reshape(ctx: Context) -> str:
    """Adds the tool triple and removes sleep."""
    from mcp.types import ServerNotification, ToolListChangedNotification

    if "sleep" in {tool.name for tool in await server.list_tools()}:
        server.add_tool(triple)
        server.remove_tool("sleep")
    # On the request's own stream: a streamable HTTP client reads it before the result (as a
    # stdio one does anyway), not at some time on its standalone stream.
    await ctx.session.send_notification(
        ServerNotification(ToolListChangedNotification()),
        related_request_id=ctx.request_context.request_id,
    )
    return "reshaped"


# A 1x1 PNG (70 bytes).
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8Dw"
    "HwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


@server.tool()
def picture() -> Image:
    """A picture, no text."""
    return Image(data=PNG, format="png")


@server.tool()
def captioned() -> list:
    """A caption and a picture."""
    return ["a red dot", Image(data=PNG, format="png")]


if __name__ == "__main__":
    time.sleep(float(os.environ.get("FIXTURE_START_DELAY", "0")))
    server.run(transport="stdio" if sys.argv[1] == "stdio" else "streamable-http")
