"""An MCP stdio server on the official SDK's low-level server, for what its high-level one does not do: tools
listed in two pages (``alpha``, then ``beta`` after a cursor), a tool that adds another and says so
(``grow`` adds ``sprout`` and sends ``notifications/tools/list_changed``), a result whose structuredContent
its own outputSchema refuses (``badout``)."""

from __future__ import annotations

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

NO_ARGUMENTS = {"type": "object", "properties": {}}
grown = False


def tool(name: str, output_schema: dict | None = None) -> types.Tool:
    return types.Tool(name=name, description=name, inputSchema=NO_ARGUMENTS, outputSchema=output_schema)


def text(value: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=value)])


async def list_tools(ctx, params) -> types.ListToolsResult:
    if params is None or params.cursor is None:
        return types.ListToolsResult(tools=[tool("alpha"), tool("grow")], nextCursor="page-2")
    number = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    return types.ListToolsResult(tools=[tool("beta"), tool("badout", number)] + ([tool("sprout")] if grown else []))


async def call_tool(ctx, params) -> types.CallToolResult:
    global grown
    if params.name == "grow":
        grown = True
        await ctx.session.send_tool_list_changed()
        return text("grown")
    if params.name == "badout":
        return types.CallToolResult(content=[text("n is seven").content[0]], structuredContent={"n": "seven"})
    return text(f"{params.name} ran")


async def main() -> None:
    server = Server("xinfer-test-lowlevel", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


anyio.run(main)
