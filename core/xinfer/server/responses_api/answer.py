"""The answer to a Responses request: one ``response`` object, or the Responses API's event
stream (``response.created``, ``response.in_progress``; per output item ``output_item.added``,
``content_part.added``, its text's deltas and ``...done``, ``content_part.done``,
``output_item.done``, a function call's ``function_call_arguments.delta`` and ``.done`` in place
of the parts and text; then ``response.completed``, ``response.incomplete`` at the token limit,
or ``response.failed``), each event with its ``sequence_number``.

The text comes from the chat route's answer (:class:`ChatAnswer`: stop texts, reasoning split,
tool calls parsed), its reasoning as a ``reasoning`` item before the ``message``, each tool call
a ``function_call`` item after it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response as HTTPResponse

from xinfer.server.chat_answer import ChatAnswer
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import stream_failure
from xinfer.server.responses import now
from xinfer.server.responses_api.objects import (
    FunctionCallItem,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseError,
    ResponseUsage,
    Status,
    item_id,
)
from xinfer.server.responses_api.protocol import ResponsesRequest
from xinfer.server.streaming import EngineStreamResponse, typed_sse_event

Kind = Literal["reasoning", "message", "function_call"]
# else failed ("abort": shut down)
STATUS: dict[str | None, Status] = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}
TEXT_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text",
               "function_call": "response.function_call_arguments"}  # fmt: skip
ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


class ResponseAnswer:
    def __init__(self, body: ResponsesRequest, chat: ChatAnswer):
        self.body, self.chat = body, chat
        self.id, self.created_at = item_id("resp"), now()
        self.sequence_number = 0

    def response(self, status: Status = "in_progress", output: list[OutputItem] | None = None,
                 error: str | None = None) -> Response:  # fmt: skip
        body, done = self.body, status != "in_progress"
        return Response(
            id=self.id, created_at=self.created_at, status=status, model=self.chat.serving.model_name,
            output=output or [], usage=ResponseUsage.of(self.chat.usage()) if done else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            error=ResponseError(message=error) if error is not None else None, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
            metadata=body.metadata or {}, completed_at=now() if status == "completed" else None,
            tools=body.tools or [], tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )  # fmt: skip

    def finished(self, items: ItemStream, finish_reason: str | None) -> tuple[Response, list[str]]:
        """The finished response and the events that close its last item."""
        status = STATUS.get(finish_reason, "failed")
        events = items.finish("completed" if status == "completed" else "incomplete")
        error = None if status != "failed" else f"the answer ended early ({finish_reason})"
        return self.response(status, items.items, error), events

    async def respond(self, request: Request) -> HTTPResponse:
        engine, handle = self.chat.serving.engine, self.chat.handle
        if self.body.stream:
            return EngineStreamResponse(self.events(), engine, handle)
        try:
            [output] = await unless_disconnected(request, engine.collect(handle))
            message = self.chat.choice(0, output).message
            items = ItemStream(lambda kind, **fields: "")  # no events
            items.write("reasoning", message.reasoning_content or "")
            items.write("message", message.content or "")
            for call in message.tool_calls or []:
                items.call(call.id, call.function.name)
                items.write("function_call", call.function.arguments)
            response, _ = self.finished(items, output.finish_reason)
            return JSONResponse(response.model_dump())
        finally:
            engine.release(handle)

    def event(self, kind: str, **fields: Any) -> str:
        number, self.sequence_number = self.sequence_number, self.sequence_number + 1
        return typed_sse_event(kind, {"type": kind, "sequence_number": number, **fields})

    async def events(self) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.response().model_dump())
        yield self.event("response.in_progress", response=self.response().model_dump())
        items = ItemStream(self.event)
        finish_reason = None
        try:
            async for choice in self.chat.deltas():
                for event in items.write("reasoning", choice.delta.reasoning_content or ""):
                    yield event
                for event in items.write("message", choice.delta.content or ""):
                    yield event
                for piece in choice.delta.tool_calls or []:
                    if piece.id is not None:
                        for event in items.call(piece.id, piece.function.name or ""):
                            yield event
                    for event in items.write("function_call", piece.function.arguments or ""):
                        yield event
                finish_reason = choice.finish_reason or finish_reason
        except Exception as error:  # noqa: BLE001 - the client gets response.failed, not a cut stream
            message = stream_failure(error, "a responses stream").message
            for event in items.close("incomplete"):
                yield event
            yield self.event("response.failed", response=self.response("failed", items.items, message).model_dump())
            return
        response, events = self.finished(items, finish_reason)
        for event in events:
            yield event
        yield self.event(f"response.{response.status}", response=response.model_dump())


class ItemStream:
    """Output items written as events: an item opens with its first text (a function call with its
    name) and is done when another item opens or the answer ends; an answer without any item gets
    one empty message."""

    def __init__(self, event: Callable[..., str]):
        self.event = event  # writes one numbered event
        self.items: list[OutputItem] = []  # those done
        self.kind: Kind | None = None
        self.id = ""
        self.texts: list[str] = []
        self.call_id, self.name = "", ""  # the open function call's

    def write(self, kind: Kind, text: str) -> list[str]:
        """A piece of the open item's text (of a function call: its arguments), opening a new item of
        text where ``kind`` is not the open item's."""
        if not text:
            return []
        events = self.open(kind) if kind != self.kind else []
        self.texts.append(text)
        return [*events, self.event(f"{TEXT_EVENTS[kind]}.delta", **self.where(), delta=text, **self.logprobs())]

    def call(self, call_id: str, name: str) -> list[str]:
        """Opens a function call: its arguments follow as ``write("function_call", ...)``."""
        events = self.close("completed")
        self.call_id, self.name = call_id, name
        return [*events, *self.open("function_call")]

    def open(self, kind: Kind) -> list[str]:
        events = self.close("completed")
        self.kind, self.id, self.texts = kind, item_id(ID_PREFIXES[kind]), []
        added = self.event("response.output_item.added", output_index=len(self.items),
                           item=self.item("in_progress").model_dump())  # fmt: skip
        if kind == "function_call":
            return [*events, added]
        part = self.event("response.content_part.added", **self.where(), part=self.part("").model_dump())
        return [*events, added, part]

    def close(self, status: Status) -> list[str]:
        if self.kind is None:
            return []
        text, item = "".join(self.texts), self.item(status)
        if self.kind == "function_call":
            text_done = [self.event(f"{TEXT_EVENTS[self.kind]}.done", **self.where(), arguments=text)]
        else:
            text_done = [
                self.event(f"{TEXT_EVENTS[self.kind]}.done", **self.where(), text=text, **self.logprobs()),
                self.event("response.content_part.done", **self.where(), part=self.part(text).model_dump()),
            ]
        events = [*text_done,
                  self.event("response.output_item.done", output_index=len(self.items), item=item.model_dump())]  # fmt: skip
        self.items.append(item)
        self.kind = None
        return events

    def finish(self, status: Status) -> list[str]:
        return [*(self.open("message") if not self.items and self.kind is None else []), *self.close(status)]

    def where(self) -> dict[str, Any]:
        place = {"item_id": self.id, "output_index": len(self.items)}
        return place if self.kind == "function_call" else place | {"content_index": 0}

    def logprobs(self) -> dict[str, Any]:
        return {"logprobs": []} if self.kind == "message" else {}

    def part(self, text: str) -> OutputText | ReasoningText:
        return OutputText(text=text) if self.kind == "message" else ReasoningText(text=text)

    def item(self, status: Status) -> OutputItem:
        """The open item: empty while in progress, then with its whole text."""
        text = "".join(self.texts)
        if self.kind == "function_call":
            return FunctionCallItem(id=self.id, call_id=self.call_id, name=self.name, arguments=text, status=status)
        if self.kind == "message":
            return OutputMessage(id=self.id, status=status,
                                 content=[OutputText(text=text)] if status != "in_progress" else [])  # fmt: skip
        return ReasoningItem(id=self.id, status=status,
                             content=[ReasoningText(text=text)] if status != "in_progress" else [])  # fmt: skip
