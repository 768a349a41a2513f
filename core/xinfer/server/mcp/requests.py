"""What a request asks of the MCP servers: which servers' tools it is offered (its ``mcp``
field: true for all, or a list of names), and their failures as HTTP errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xinfer.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from mcp.types import Tool

    from xinfer.server.mcp.client import MCPServer, MCPUnavailable
    from xinfer.server.mcp.config import MCPSettings

Offered = dict[str, "tuple[MCPServer, Tool]"]  # tool name -> its server and description


async def offered_tools(settings: MCPSettings | None, selection: bool | list[str] | None) -> Offered:
    """The MCP tools a request asks for, their servers started (502/504 if one cannot be)."""
    if not selection:
        return {}
    if settings is None:
        raise bad_request("this server has no MCP servers: start it with --mcp-command or --mcp-config", param="mcp")
    from xinfer.server.mcp.client import MCPUnavailable

    try:
        servers = settings.hub.check_names(None if selection is True else selection)
    except ValueError as error:
        raise bad_request(str(error), param="mcp") from None
    try:
        return await settings.hub.tools(servers)
    except MCPUnavailable as error:
        raise mcp_error(error) from None


def function_tools(offered: Offered) -> list[dict[str, Any]]:
    from xinfer.server.mcp.client import function_tool

    return [function_tool(tool) for _, tool in offered.values()]


def mcp_error(error: MCPUnavailable) -> APIError:
    """A server that did not answer in time is a 504, one that failed a 502."""
    return APIError(504 if error.timed_out else 502, str(error), param="mcp", code="mcp_server_error")
