"""OpenAI's Responses API: ``POST /v1/responses``.

A Responses body is translated into the chat request it means (the same template, sampling
and engine as ``/v1/chat/completions``, :mod:`xinfer.server.responses_api.convert`), and its
answer written as a ``response`` object or the Responses API's events. Function tools are the
chat route's (the client runs the calls and sends their ``function_call_output`` back). Nothing
is stored: a field that needs a stored response (``previous_response_id``), a built-in tool, or
another feature this server does not implement is a 400 naming it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xinfer.server.body import parse_body
from xinfer.server.chat_answer import ChatAnswer
from xinfer.server.chat_run import submit_chat
from xinfer.server.responses_api.answer import ResponseAnswer
from xinfer.server.responses_api.convert import chat_request
from xinfer.server.responses_api.protocol import ResponsesRequest
from xinfer.server.serving import Serving

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, ResponsesRequest)
    serving.check_model(body.model)
    handle, prompt, chat = await submit_chat(request, serving, chat_request(body, bool(serving.llm.modalities)))
    answer = ChatAnswer(serving, chat, handle, prompt.tags, prompt.inside, prompt.tools)
    return await ResponseAnswer(body, answer).respond(request)
