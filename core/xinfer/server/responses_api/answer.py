"""The answer to a Responses request: one ``response`` object, or the Responses API's event
stream (``response.created``, ``response.in_progress``; per output item ``output_item.added``,
``content_part.added``, its text's deltas and ``...done``, ``content_part.done``,
``output_item.done``, a function call's ``function_call_arguments.delta`` and ``.done`` in place
of the parts and text; then ``response.completed``, ``response.incomplete`` at the token limit,
or ``response.failed``), each event with its ``sequence_number``.

The text comes from the chat route's answer (:class:`ChatAnswer`: stop texts, reasoning split,
tool calls parsed), its reasoning as a ``reasoning`` item before the ``message``, each tool call
a ``function_call`` item after it. Where ``include`` asks for them, the message's ``output_text`` has
the logprobs of its tokens (those after the reasoning, up to the first call's), each text delta
those of the tokens it adds."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response as HTTPResponse

from xinfer.server.chat_answer import ChatAnswer
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import server_failure
from xinfer.server.responses import TokenLogprob, now
from xinfer.server.responses_api.objects import (
    FunctionCallItem,
    IncompleteDetails,
    ItemStatus,
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
from xinfer.server.responses_api.protocol import Reasoning, ResponsesRequest, TextConfig
from xinfer.server.streaming import EngineStreamResponse, typed_sse_event

Kind = Literal["reasoning", "message", "function_call"]
# else failed (a request failed or cut off at shutdown raises instead)
STATUS: dict[str | None, Status] = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}
TEXT_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text",
               "function_call": "response.function_call_arguments"}  # fmt: skip
ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}
# the logprobs of a message's tokens, given its text so far: those of the tokens that write it, or (``whole``)
# all those to the output's end
MessageLogprobs = Callable[[str, bool], list[TokenLogprob]]


class ResponseAnswer:
    """``keep``: called with the finished response (completed or incomplete), to keep it."""

    def __init__(self, body: ResponsesRequest, chat: ChatAnswer, keep: Callable[[Response], None] | None = None):
        self.body, self.chat, self.keep = body, chat, keep
        self.id, self.created_at = item_id("resp"), now()
        self.sequence_number = 0

    def response(self, status: Status = "in_progress", output: list[OutputItem] | None = None,
                 error: str | None = None) -> Response:  # fmt: skip
        done = status != "in_progress"
        return Response(
            id=self.id, created_at=self.created_at, status=status, model=self.chat.serving.model_name,
            output=output or [], usage=ResponseUsage.of(self.chat.usage()) if done else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            error=ResponseError(message=error) if error is not None else None,
            completed_at=now() if status == "completed" else None, **request_fields(self.body),
        )  # fmt: skip

    def finished(self, items: ItemStream, finish_reason: str | None) -> tuple[Response, list[str]]:
        """The finished response and the events that close its last item."""
        status = STATUS.get(finish_reason, "failed")
        events = items.finish("completed" if status == "completed" else "incomplete")
        error = None if status != "failed" else f"the answer ended early ({finish_reason})"
        response = self.response(status, items.items, error)
        if self.keep is not None and status != "failed":
            self.keep(response)
        return response, events

    async def respond(self, request: Request) -> HTTPResponse:
        engine, handle = self.chat.serving.engine, self.chat.handle
        if self.body.stream:
            return EngineStreamResponse(self.events(), engine, handle)
        try:
            [output] = await unless_disconnected(request, engine.collect(handle))
            message = self.chat.choice(0, output).message
            items = ItemStream(lambda kind, **fields: "", self.message_logprobs())  # no events
            items.write("reasoning", message.reasoning_content or "")
            items.write("message", message.content or "")
            for call in message.tool_calls or []:
                items.call(call.id, call.function.name)
                items.write("function_call", call.function.arguments)
            response, _ = self.finished(items, output.finish_reason)
            return JSONResponse(response.model_dump())
        finally:
            engine.release(handle)

    def message_logprobs(self) -> MessageLogprobs | None:
        """The logprobs of the message's tokens, from the output so far, where ``include`` asks for them."""
        if not self.body.output_logprobs:
            return None
        chat = self.chat

        def logprobs(text: str, whole: bool) -> list[TokenLogprob]:
            output = chat.handle.choices[0]
            start = chat.reasoning_length(output.token_ids)
            token_ids = output.token_ids[start:]
            count = len(token_ids) if whole else writing(token_ids, text, chat.serving.token_bytes)
            found = chat.logprobs(token_ids[:count], (output.logprobs or [])[start : start + count])
            return found.content if found is not None else []

        return logprobs

    def event(self, kind: str, **fields: Any) -> str:
        number, self.sequence_number = self.sequence_number, self.sequence_number + 1
        return typed_sse_event(kind, {"type": kind, "sequence_number": number, **fields})

    async def events(self) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.response().model_dump())
        yield self.event("response.in_progress", response=self.response().model_dump())
        items = ItemStream(self.event, self.message_logprobs())
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
            message = server_failure(error, "a responses stream").message
            for event in items.close("incomplete", last=True):
                yield event
            yield self.event("response.failed", response=self.response("failed", items.items, message).model_dump())
            return
        response, events = self.finished(items, finish_reason)
        for event in events:
            yield event
        yield self.event(f"response.{response.status}", response=response.model_dump())


def request_fields(body: ResponsesRequest) -> dict[str, Any]:
    """The request's fields a response repeats, as OpenAI's does: those left out as their defaults."""
    text = body.text or TextConfig()
    text_format = text.format.model_dump(by_alias=True, exclude_none=True) if text.format else {"type": "text"}
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_logprobs": body.top_logprobs,
        "metadata": body.metadata or {}, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "text": {"format": text_format, "verbosity": text.verbosity or "medium"},
        "reasoning": (body.reasoning or Reasoning()).model_dump(), "store": body.store, "user": body.user,
        "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention, "max_tool_calls": body.max_tool_calls,
    }  # fmt: skip


class ItemStream:
    """Output items written as events: an item opens with its first text (a function call with its
    name) and is done when another item opens or the answer ends; an answer without any item gets
    one empty message."""

    def __init__(self, event: Callable[..., str], message_logprobs: MessageLogprobs | None = None):
        self.event = event  # writes one numbered event
        self.message_logprobs = message_logprobs
        self.token_logprobs: list[TokenLogprob] = []  # the open message's, so far
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
        logprobs = self.logprobs(self.more_logprobs(whole=False))
        return [*events, self.event(f"{TEXT_EVENTS[kind]}.delta", **self.where(), delta=text, **logprobs)]

    def call(self, call_id: str, name: str) -> list[str]:
        """Opens a function call: its arguments follow as ``write("function_call", ...)``."""
        events = self.close("completed")
        self.call_id, self.name = call_id, name
        return [*events, *self.open("function_call")]

    def open(self, kind: Kind) -> list[str]:
        events = self.close("completed")
        self.kind, self.id, self.texts, self.token_logprobs = kind, item_id(ID_PREFIXES[kind]), [], []
        added = self.event("response.output_item.added", output_index=len(self.items),
                           item=self.item("in_progress").model_dump())  # fmt: skip
        if kind == "function_call":
            return [*events, added]
        part = self.event("response.content_part.added", **self.where(), part=self.part("").model_dump())
        return [*events, added, part]

    def close(self, status: ItemStatus, last: bool = False) -> list[str]:
        """``last``: the output ends with this item (its tokens are all the rest)."""
        if self.kind is None:
            return []
        self.more_logprobs(whole=last)
        text, item = "".join(self.texts), self.item(status)
        if self.kind == "function_call":
            text_done = [self.event(f"{TEXT_EVENTS[self.kind]}.done", **self.where(), arguments=text)]
        else:
            text_done = [
                self.event(
                    f"{TEXT_EVENTS[self.kind]}.done", **self.where(), text=text, **self.logprobs(self.token_logprobs)
                ),
                self.event("response.content_part.done", **self.where(), part=self.part(text).model_dump()),
            ]
        events = [*text_done,
                  self.event("response.output_item.done", output_index=len(self.items), item=item.model_dump())]  # fmt: skip
        self.items.append(item)
        self.kind = None
        return events

    def finish(self, status: ItemStatus) -> list[str]:
        return [*(self.open("message") if not self.items and self.kind is None else []), *self.close(status, last=True)]

    def where(self) -> dict[str, Any]:
        place = {"item_id": self.id, "output_index": len(self.items)}
        return place if self.kind == "function_call" else place | {"content_index": 0}

    def more_logprobs(self, whole: bool) -> list[TokenLogprob]:
        """The open message's logprobs that its text (``whole``: the output's end) adds to those it had."""
        if self.kind != "message" or self.message_logprobs is None:
            return []
        known = self.message_logprobs("".join(self.texts), whole)
        more, self.token_logprobs = known[len(self.token_logprobs) :], known
        return more

    def logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """A message's text event's ``logprobs`` (none for reasoning)."""
        return {"logprobs": [entry.model_dump() for entry in logprobs]} if self.kind == "message" else {}

    def part(self, text: str) -> OutputText | ReasoningText:
        if self.kind == "message":
            return OutputText(text=text, logprobs=self.token_logprobs)
        return ReasoningText(text=text)

    def item(self, status: ItemStatus) -> OutputItem:
        """The open item: empty while in progress, then with its whole text."""
        text = "".join(self.texts)
        if self.kind == "function_call":
            return FunctionCallItem(id=self.id, call_id=self.call_id, name=self.name, arguments=text, status=status)
        if self.kind == "message":
            return OutputMessage(id=self.id, status=status,
                                 content=[self.part(text)] if status != "in_progress" else [])  # fmt: skip
        return ReasoningItem(id=self.id, status=status,
                             content=[ReasoningText(text=text)] if status != "in_progress" else [])  # fmt: skip


def writing(token_ids: list[int], text: str, token_bytes: Callable[[int], bytes]) -> int:
    """How many of the first tokens it takes to write ``text``: their bytes at least as many as its."""
    size, goal = 0, len(text.encode())
    for count, token in enumerate(token_ids):
        if size >= goal:
            return count
        size += len(token_bytes(token))
    return len(token_ids)
