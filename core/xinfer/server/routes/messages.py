"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages body is translated into the chat request it means (the same template, sampling
and engine as ``/v1/chat/completions``), and its answer written in Anthropic's shapes;
errors on these routes have Anthropic's shape (:mod:`xinfer.server.errors`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from xinfer.server.body import parse_body
from xinfer.server.chat_run import chat_prompt, submit_chat
from xinfer.server.messages.answer import MessageAnswer
from xinfer.server.messages.convert import chat_request
from xinfer.server.messages.protocol import CountTokensRequest, MessagesRequest
from xinfer.server.messages.responses import TokenCount
from xinfer.server.serving import Serving

router = APIRouter()


@router.post("/v1/messages", response_model=None)
async def create_message(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, MessagesRequest)
    serving.check_model(body.model)
    chat = chat_request(body)
    handle, prompt = await submit_chat(request, serving, chat)
    return await MessageAnswer(serving, handle, prompt, chat.stop_strings).respond(request, body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, CountTokensRequest)
    serving.check_model(body.model)
    prompt = await chat_prompt(serving, chat_request(body))
    return JSONResponse(TokenCount(input_tokens=len(prompt.token_ids)).model_dump())
