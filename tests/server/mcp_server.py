"""An MCP stdio server for the tests, written with the official SDK's server side.

``python tests/server/mcp_server.py MODE``: ``tools`` serves the tools below; ``silent`` never
answers (a server that hangs from the start); ``exit`` dies before answering.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mcp.server.mcpserver import Audio, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, EmbeddedResource, ResourceLink, TextResourceContents

server = MCPServer("xinfer-test-tools")


@server.tool()
def add(a: int, b: int) -> str:
    """Adds two integers."""
    return str(a + b)


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@server.tool()
def refuse(reason: str) -> str:
    """Always fails, with the reason given."""
    raise ToolError(f"refused: {reason}")


@server.tool()
def crash() -> str:
    """Kills this server mid-call."""
    os._exit(3)


@server.tool()
def hang() -> str:
    """Never returns."""
    while True:
        time.sleep(60)


@server.tool()
def wait(seconds: float) -> str:
    """Answers after ``seconds``."""
    time.sleep(seconds)
    return "waited"


@server.tool()
def slow() -> str:
    """Touches the file $MCP_TEST_STARTED names, then answers after 4 s."""
    Path(os.environ["MCP_TEST_STARTED"]).touch()
    time.sleep(4)
    return "slept"


@server.tool()
def pid() -> str:
    """This server's process id."""
    return str(os.getpid())


@server.tool()
def flood() -> str:
    """More words than a small model's context holds."""
    return "word " * 20_000


@server.tool()
def contents() -> list:
    """Text, an image, audio, an embedded text resource and a resource link."""
    note = EmbeddedResource(type="resource", resource=TextResourceContents(uri="file:///notes.txt", text="noted"))
    link = ResourceLink(type="resource_link", uri="file:///report.pdf", name="report.pdf")
    return ["before", Image(data=b"png", format="png"), Audio(data=b"wav", format="wav"), note, link, "after"]


@server.tool()
def structured() -> CallToolResult:
    """A result with structuredContent only."""
    return CallToolResult(content=[], structured_content={"city": "Paris", "temp_c": 21})


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "tools"
    if mode == "silent":
        while True:
            time.sleep(60)
    elif mode == "exit":
        sys.exit(2)
    server.run("stdio")
