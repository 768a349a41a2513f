"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel`` (refused: no response runs in the background).

A Responses body is translated into the chat request it means (the same template, sampling
and engine as ``/v1/chat/completions``, :mod:`xinfer.server.responses_api.convert`), and its
answer written as a ``response`` object or the Responses API's events. Function tools are the
chat route's (the client runs the calls and sends their ``function_call_output`` back). A response
is kept (``store``, true by default) so that another can continue it (``previous_response_id``) and a
client can read it back (:mod:`xinfer.server.responses_api.store`). A built-in tool, or another feature
this server does not implement, is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from xinfer.server.body import parse_body
from xinfer.server.chat_answer import ChatAnswer
from xinfer.server.chat_run import submit_chat
from xinfer.server.errors import bad_request
from xinfer.server.responses_api.answer import ResponseAnswer
from xinfer.server.responses_api.convert import chat_request
from xinfer.server.responses_api.protocol import ResponsesRequest
from xinfer.server.responses_api.store import ResponseStore, listed
from xinfer.server.serving import Serving

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    store: ResponseStore = request.app.state.responses
    body = await parse_body(request, ResponsesRequest)
    serving.check_model(body.model)
    previous = [] if body.previous_response_id is None else store.conversation(body.previous_response_id)
    handle, prompt, chat = await submit_chat(
        request, serving, chat_request(body, previous, bool(serving.llm.modalities))
    )
    answer = ChatAnswer(serving, chat, handle, prompt.tags, prompt.inside, prompt.tools)
    keep = (lambda response: store.keep(response, previous, body.input_items())) if body.store else None
    return await ResponseAnswer(body, answer, keep).respond(request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> JSONResponse:
    store: ResponseStore = request.app.state.responses
    return JSONResponse(store.get(response_id).model_dump())


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    request: Request,
    response_id: str,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    """The items a kept response was given, a page of ``limit`` after the item ``after``, newest first by default."""
    store: ResponseStore = request.app.state.responses
    items = store.input_items(response_id)
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise bad_request(f"no input item with id {after!r} in response {response_id!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = [listed(item) for item in items[:limit]]
    return JSONResponse({
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit,
    })  # fmt: skip


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> JSONResponse:
    """Only a background response can be cancelled, as on OpenAI's API; this server runs none (``background`` is
    refused), so a kept response is refused as OpenAI refuses one that was not."""
    store: ResponseStore = request.app.state.responses
    store.get(response_id)  # an id not kept: a 404, as GET's
    raise bad_request("Cannot cancel a synchronous response.")


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    store: ResponseStore = request.app.state.responses
    store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
