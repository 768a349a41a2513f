"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages body is translated into the chat request it means (the same template, sampling
and engine as ``/v1/chat/completions``), and its answer written in Anthropic's shapes;
errors on these routes have Anthropic's shape (:mod:`xinfer.server.errors`).

xinfer's extra field ``mcp`` (true, or a list of server names) offers the tools of the
``--mcp-*`` servers; with ``--mcp-tool-calls server`` their calls are run here
(:mod:`xinfer.server.mcp.loop`) and a streamed answer comes as one block per event (a streamed answer
without them streams its text and tool_use blocks as they are generated).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from xinfer.server.body import parse_body
from xinfer.server.chat_run import chat_prompt, submit_chat, with_tools
from xinfer.server.mcp.requests import function_tools, offered_tools
from xinfer.server.messages.answer import MessageAnswer, message_events
from xinfer.server.messages.convert import chat_request
from xinfer.server.messages.protocol import CountTokensRequest, MessagesRequest
from xinfer.server.messages.responses import TokenCount
from xinfer.server.serving import Serving
from xinfer.server.streaming import SSE_HEADERS

router = APIRouter()


@router.post("/v1/messages", response_model=None)
async def create_message(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, MessagesRequest)
    serving.check_model(body.model)
    offered = await offered_tools(serving.mcp, body.mcp)
    chat = chat_request(body, bool(serving.llm.modalities), function_tools(offered))
    if offered and serving.mcp is not None and serving.mcp.run_calls:
        from xinfer.server.mcp.loop import MCPRounds
        from xinfer.server.mcp.messages import message_with_mcp

        message = await message_with_mcp(MCPRounds(request, serving, serving.mcp, chat, offered))
        if body.stream:
            return StreamingResponse(iter(message_events(message)), media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(message.model_dump())
    handle, prompt, chat = await submit_chat(request, serving, chat)
    return await MessageAnswer(serving, handle, prompt, chat.stop_strings).respond(request, body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, CountTokensRequest)
    serving.check_model(body.model)
    offered = await offered_tools(serving.mcp, body.mcp)
    chat, tools = with_tools(serving, chat_request(body, bool(serving.llm.modalities), function_tools(offered)))
    prompt = await chat_prompt(serving, chat, tools)
    return JSONResponse(TokenCount(input_tokens=len(prompt.token_ids)).model_dump())
