"""Connections to MCP stdio servers through the official SDK.

Each server is one subprocess whose session lives in its own task (the SDK's context
managers are entered and left in one task), started when the HTTP server starts and again
after it failed. Every wait on a server (starting, listing, calling) is bounded by
``--mcp-timeout``: a server that crashes or hangs fails the requests that use it, with an
error naming it, and no other request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, cast

from anyio.streams.memory import MemoryObjectReceiveStream
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp.types import (
    CONNECTION_CLOSED,
    REQUEST_TIMEOUT,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    PaginatedRequestParams,
    ResourceLink,
    TextContent,
    TextResourceContents,
    Tool,
    ToolListChangedNotification,
)

from xinfer.server.mcp.config import ServerSpec
from xinfer.server.tools import check_tools

log = logging.getLogger("xinfer.mcp")

STOP_GRACE_S = 5.0  # how long a closing session may take to end its subprocess


class MCPUnavailable(Exception):
    """A server could not be used: it failed to start, crashed, or did not answer in time."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class ToolResult:
    text: str
    is_error: bool = False


class MCPServer:
    def __init__(self, spec: ServerSpec, timeout: float):
        self.spec = spec
        self.timeout = timeout
        self.tools: list[Tool] = []
        self._session: ClientSession | None = None
        self._read: MemoryObjectReceiveStream | None = None  # the session's messages from the subprocess
        self._task: asyncio.Task | None = None
        self._closing = asyncio.Event()
        self._lock = asyncio.Lock()
        self._listing: asyncio.Task | None = None  # a tools/list the server asked for (list_changed)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def connected(self) -> bool:
        running = self._session is not None and self._task is not None and not self._task.done()
        return running and self._read is not None and not transport_ended(self._read)

    async def connect(self) -> None:
        """Starts the server (again, if it failed or exited) and lists its tools; MCPUnavailable if that
        fails or times out."""
        async with self._lock:
            if self.connected:
                return
            if self._task is not None:
                log.warning("MCP server %r is gone: starting it again", self.name)
            await self._stop()
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._closing = asyncio.Event()
            self._task = asyncio.create_task(self._run(ready), name=f"mcp-{self.name}")
            try:
                await asyncio.wait_for(asyncio.shield(ready), self.timeout)
            except asyncio.TimeoutError:
                await self._stop()
                raise MCPUnavailable(
                    f"MCP server {self.name!r} did not start within {self.timeout:g} s (--mcp-timeout)", timed_out=True
                ) from None
            except Exception as error:  # noqa: BLE001 - whatever the SDK or the subprocess raised, named
                await self._stop()
                raise MCPUnavailable(f"MCP server {self.name!r} failed to start: {describe(error)}") from None

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Runs ``tool``; its own errors (``isError``, a JSON-RPC error) are a result the model reads;
        a call past ``--mcp-timeout`` is MCPUnavailable (the server kept), a server that crashes is
        MCPUnavailable (and restarted by the next request)."""
        await self.connect()
        session = self._session
        assert session is not None
        try:
            # the SDK's per-request timeout fails this call only (and tells the server to cancel it);
            # the session and the other requests' calls on it go on
            result = await session.call_tool(tool, arguments, read_timeout_seconds=self.timeout)
        except MCPError as error:
            if error.code == REQUEST_TIMEOUT:
                raise MCPUnavailable(
                    f"MCP server {self.name!r} did not answer the call of {tool!r} within {self.timeout:g} s "
                    "(--mcp-timeout)",
                    timed_out=True,
                ) from None
            if error.code != CONNECTION_CLOSED:  # the server answered: the call itself failed
                return ToolResult(f"Error: {error.message}", is_error=True)
            await self.reset()
            raise MCPUnavailable(f"MCP server {self.name!r} closed the connection while calling {tool!r}") from None
        except Exception as error:  # noqa: BLE001 - a broken connection, however the SDK reports it
            if self.connected:  # the server answered, wrongly (a structuredContent its outputSchema refuses)
                return ToolResult(f"Error: {describe(error)}", is_error=True)
            await self.reset()
            raise MCPUnavailable(f"MCP server {self.name!r} failed while calling {tool!r}: {describe(error)}") from None
        return ToolResult(result_text(result), bool(result.is_error))

    async def reset(self, graceful: bool = False) -> None:
        async with self._lock:
            await self._stop(graceful)

    async def _run(self, ready: asyncio.Future[None]) -> None:
        spec = self.spec
        params = StdioServerParameters(command=spec.command, args=spec.args, env=spec.env)
        try:
            handler = self._on_message
            async with (
                stdio_client(params) as (read, write),
                ClientSession(read, write, message_handler=handler) as session,
            ):
                await session.initialize()
                await self._list_tools(session)
                # (stdio_client's read stream is anyio's memory stream, which its protocol type does not say)
                self._session, self._read = session, cast(MemoryObjectReceiveStream, read)
                ready.set_result(None)
                await self._closing.wait()
        except Exception as error:  # noqa: BLE001 - reported to the waiting request, or logged
            if not ready.done():
                ready.set_exception(error)
            else:
                log.warning("MCP server %r stopped: %s", self.name, describe(error))
        finally:
            self._session = self._read = None

    async def _list_tools(self, session: ClientSession) -> None:
        """The server's tools, every page of them."""
        listed, cursor = [], None
        while True:
            page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            listed += page.tools
            if not (cursor := page.next_cursor):
                break
        self.tools = usable_tools(self.name, listed)
        log.info("MCP server %r: %d tools (%s)", self.name, len(self.tools), ", ".join(t.name for t in self.tools))

    async def _on_message(self, message: object) -> None:
        """A server whose tools changed (``notifications/tools/list_changed``) is listed again, apart from the
        session's reading of messages, which the listing waits on."""
        if isinstance(message, ToolListChangedNotification) and self._session is not None:
            self._listing = asyncio.create_task(self._list_tools(self._session), name=f"mcp-{self.name}-tools")

    async def _stop(self, graceful: bool = False) -> None:
        """Ends the session's task, which ends the subprocess: ``graceful``, by closing the session
        (cancelled if that takes too long); else (a server that failed) by cancelling it now."""
        task, self._task, self._session, self._read = self._task, None, None, None
        if self._listing is not None:  # a listing of the session that ends (it would fail on the closed session)
            self._listing.cancel()
            self._listing = None
        if task is None or task.done():
            return
        self._closing.set()
        if graceful:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), STOP_GRACE_S)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class MCPHub:
    """The configured servers and their tools, by tool name (a name two servers share: the first's, in the order
    a request names them, with a warning)."""

    def __init__(self, specs: list[ServerSpec], timeout: float):
        self.servers = {spec.name: MCPServer(spec, timeout) for spec in specs}
        self._warned: set[tuple[str, ...]] = set()

    async def start(self) -> None:
        """Connects every server; failures are logged (a request that needs the server tries again)."""
        outcomes = await asyncio.gather(*(s.connect() for s in self.servers.values()), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                log.warning("%s", outcome)

    def check_names(self, names: list[str] | None) -> list[MCPServer]:
        """The servers a request names (None: all); ValueError for a name not configured."""
        if names is None:
            return list(self.servers.values())
        unknown = [name for name in names if name not in self.servers]
        if unknown:
            raise ValueError(f"no MCP server named {unknown[0]!r}; this server has: {', '.join(self.servers)}")
        return [self.servers[name] for name in dict.fromkeys(names)]

    async def tools(self, servers: list[MCPServer]) -> dict[str, tuple[MCPServer, Tool]]:
        """The tools of ``servers`` by name, each server connected (MCPUnavailable if one cannot be)."""
        await asyncio.gather(*(server.connect() for server in servers))
        found: dict[str, tuple[MCPServer, Tool]] = {}
        for server in servers:
            for tool in server.tools:
                first, _ = found.setdefault(tool.name, (server, tool))
                if first is not server and (clash := (tool.name, first.name, server.name)) not in self._warned:
                    self._warned.add(clash)
                    log.warning("MCP servers %r and %r both have a tool %r: the first named, %r, serves it",
                                first.name, server.name, tool.name, first.name)  # fmt: skip
        return found

    async def close(self) -> None:
        await asyncio.gather(*(s.reset(graceful=True) for s in self.servers.values()), return_exceptions=True)


def result_text(result: CallToolResult) -> str:
    """A tool result as the text the model reads: each content block's text, or a note of what it is
    (binary data is not shown); a result with ``structuredContent`` only, that as JSON."""
    if not result.content and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(block_text(block) for block in result.content)


def block_text(block: ContentBlock) -> str:
    if isinstance(block, TextContent):
        return block.text
    if isinstance(block, EmbeddedResource):
        resource = block.resource
        if isinstance(resource, TextResourceContents):
            return resource.text
        return f"[resource: {resource.uri} ({resource.mime_type or 'binary'})]"
    if isinstance(block, ResourceLink):
        return f"[resource link: {block.name} {block.uri}]"
    return f"[{block.type}: {block.mime_type}]"  # image, audio


def transport_ended(read: MemoryObjectReceiveStream) -> bool:
    """Whether the stdio transport stopped sending: the subprocess's stdout ended (it exited or died,
    possibly while idle, which the session itself only notices on its next request)."""
    return read.statistics().open_send_streams == 0


def usable_tools(server: str, tools: list[Tool]) -> list[Tool]:
    """The tools a request may be offered: those that make an OpenAI function tool. One that does not (a name
    past 64 characters, which MCP allows up to 128; a schema that is not an object's) is left out with a warning:
    offered, it failed every request that asked for the server's tools."""
    usable = []
    for tool in tools:
        try:
            check_tools([function_tool(tool)])
        except ValueError as error:
            log.warning("MCP server %r: tool %r left out, not a function tool a model can call: %s", server,
                        tool.name, error)  # fmt: skip
        else:
            usable.append(tool)
    return usable


def function_tool(tool: Tool) -> dict[str, Any]:
    """An MCP tool as an OpenAI function tool (what chat templates read)."""
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def describe(error: BaseException) -> str:
    """An error in one line, the innermost of an exception group (the SDK's task groups wrap them)."""
    while getattr(error, "exceptions", None):  # an exception group (Python 3.10: the backport's)
        error = error.exceptions[0]  # type: ignore[attr-defined]
    text = str(error) or type(error).__name__
    return text.splitlines()[0] if text.strip() else type(error).__name__
