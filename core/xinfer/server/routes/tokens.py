"""``POST /tokenize`` (a prompt or chat messages) and ``POST /detokenize``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from xinfer.server.body import parse_body
from xinfer.server.prompts import check_token_ids, message_dicts, render_chat
from xinfer.server.protocol import DetokenizeRequest, TokenizeRequest
from xinfer.server.responses import DetokenizeResult, TokenizeResult
from xinfer.server.serving import Serving
from xinfer.server.tools import tool_use

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, TokenizeRequest)
    serving.check_model(body.model)
    tokenizer = serving.tokenizer
    if body.messages is not None:
        serving.check_takes_images(message_dicts(body.messages)[1])  # as a chat completion refuses them
        tools = tool_use(body.tools, None, None, serving.tool_family).template_tools
        text = render_chat(tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message, tools,
                           body.chat_template_kwargs)  # fmt: skip
        special = bool(body.add_special_tokens)  # a template writes its own BOS
    else:
        assert body.prompt is not None  # the request's validator requires prompt or messages
        text, special = body.prompt, body.add_special_tokens is not False
    tokens = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=special)  # (off the event loop)
    result = TokenizeResult(tokens=tokens, count=len(tokens), max_model_len=serving.max_model_len)
    return JSONResponse(result.model_dump())


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, DetokenizeRequest)
    serving.check_model(body.model)
    if body.tokens:
        check_token_ids(body.tokens, serving.vocab_size, "tokens")
    text = serving.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return JSONResponse(DetokenizeResult(prompt=text).model_dump())
