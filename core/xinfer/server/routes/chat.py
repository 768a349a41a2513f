"""``POST /v1/chat/completions``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xinfer.server.body import parse_body
from xinfer.server.chat_answer import ChatAnswer
from xinfer.server.chat_run import submit_chat
from xinfer.server.errors import FieldError, bad_request
from xinfer.server.mcp.requests import function_tools, offered_tools
from xinfer.server.protocol import ChatCompletionRequest
from xinfer.server.serving import Serving
from xinfer.server.tools import check_tool_choice

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, ChatCompletionRequest)
    serving.check_model(body.model)
    offered = await offered_tools(serving.mcp, body.mcp)
    if offered:
        body = with_extra_tools(body, function_tools(offered))
        if serving.mcp is not None and serving.mcp.run_calls:
            if body.n != 1:
                raise bad_request("the server runs MCP calls for one choice only: n must be 1", param="n")
            from xinfer.server.mcp.chat import chat_with_mcp
            from xinfer.server.mcp.loop import MCPRounds

            return await chat_with_mcp(MCPRounds(request, serving, serving.mcp, body, offered), body.stream)
    handle, prompt, body = await submit_chat(request, serving, body)
    return await ChatAnswer(serving, body, handle, prompt.tags, prompt.inside, prompt.tools).respond(request)


def with_extra_tools(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> ChatCompletionRequest:
    """``body`` with ``tools`` (the MCP servers', each checked as they were listed) offered beside its own."""
    check_own_names(body.tools or [], tools)
    all_tools = [*(body.tools or []), *tools]
    try:
        check_tool_choice(body.tool_choice, all_tools)
    except FieldError as error:
        raise bad_request(str(error), param=error.param) from None
    return body.model_copy(update={"tools": all_tools})


def check_own_names(own: list[dict[str, Any]], mcp: list[dict[str, Any]]) -> None:
    """A 400 for a request tool named like an offered MCP tool: the model's call of that name would be
    run on the MCP server, never reach the client."""
    mcp_names = {tool["function"]["name"] for tool in mcp}
    for i, tool in enumerate(own):  # checked as function tools when the body was read
        name = tool["function"]["name"]
        if name in mcp_names:
            raise bad_request(f"tools[{i}].function.name {name!r} is also an MCP server's tool (mcp): "
                              "give the request's tool another name", param=f"tools[{i}].function.name")  # fmt: skip
