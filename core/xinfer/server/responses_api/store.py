"""Responses kept for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``, as OpenAI keeps them
(``store``, true by default): in memory, the last :data:`CAPACITY` used and at most :data:`MAX_BYTES` of their own
text (images' data URLs included), lost when the server stops.

A kept response holds its conversation as input items: the items it was given (those of the response it
continued first) and its own output as the items a client would give back (its message as an assistant
message, its reasoning, its function calls), so that continuing it is giving the model all of them again.
Every item has an id (an output item's own; one given here to an input item sent without), so that the items
a response was given can be listed a page at a time (``GET /v1/responses/{id}/input_items``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from xinfer.server.errors import APIError, bad_request
from xinfer.server.responses_api.objects import FunctionCallItem, OutputItem, OutputMessage, Response, item_id
from xinfer.server.responses_api.protocol import InputItem, InputPart

CAPACITY = 1000
MAX_BYTES = 256 * 2**20
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclass(frozen=True)
class Kept:
    response: Response
    conversation: list[InputItem]  # what it was given, then its output items (one input item each)
    size: int  # the characters of its own input and output (those of the response it continues are that one's)


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY, max_bytes: int = MAX_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._size = 0

    def keep(self, response: Response, previous: list[InputItem], own: list[InputItem]) -> None:
        """``previous``: the conversation of the response it continued; ``own``: its request's input items."""
        mine = [*map(_with_id, own), *(as_input(item) for item in response.output)]
        kept = self._kept[response.id] = Kept(response, [*previous, *mine], sum(map(_size, mine)))
        self._size += kept.size
        while self._kept and (len(self._kept) > self.capacity or self._size > self.max_bytes):
            self._size -= self._kept.popitem(last=False)[1].size

    def conversation(self, previous_response_id: str) -> list[InputItem]:
        """The items a response continuing ``previous_response_id`` is given before its own input."""
        kept = self._kept.get(previous_response_id)
        if kept is None:
            raise bad_request(f"previous response with id {previous_response_id!r} not found (responses are kept "
                              "in memory, the last used while there is room, with store true)",
                              param="previous_response_id", code="previous_response_not_found")  # fmt: skip
        self._kept.move_to_end(previous_response_id)
        return kept.conversation

    def get(self, response_id: str) -> Response:
        return self._get(response_id).response

    def input_items(self, response_id: str) -> list[InputItem]:
        """The items ``response_id`` was given, in order: those of the conversation it continued, then its own."""
        kept = self._get(response_id)
        return kept.conversation[: len(kept.conversation) - len(kept.response.output)]

    def delete(self, response_id: str) -> None:
        self._get(response_id)
        self._size -= self._kept.pop(response_id).size

    def _get(self, response_id: str) -> Kept:
        kept = self._kept.get(response_id)
        if kept is None:
            raise APIError(404, f"no response with id {response_id!r} is kept", param="response_id", code="not_found")
        return kept


def _with_id(item: InputItem) -> InputItem:
    return item if item.id is not None else item.model_copy(update={"id": item_id(ID_PREFIXES.get(item.type, "item"))})


def _size(item: InputItem) -> int:
    parts = item.content if isinstance(item.content, list) else []
    texts = [item.content if isinstance(item.content, str) else "", item.arguments or "",
             item.output if isinstance(item.output, str) else ""]  # fmt: skip
    texts += [part.text or part.image_url or "" for part in parts]
    return sum(map(len, texts))


def as_input(item: OutputItem) -> InputItem:
    """An output item as the input item a client gives back for it."""
    if isinstance(item, OutputMessage):
        parts = [InputPart(type="output_text", text=part.text) for part in item.content]
        return InputItem(id=item.id, status=item.status, type="message", role="assistant", content=parts)
    if isinstance(item, FunctionCallItem):
        return InputItem(id=item.id, status=item.status, type="function_call", call_id=item.call_id, name=item.name,
                         arguments=item.arguments)  # fmt: skip
    return InputItem(
        id=item.id,
        status=item.status,
        type="reasoning",
        content=[InputPart(type="reasoning_text", text=part.text) for part in item.content],
    )


def listed(item: InputItem) -> dict[str, Any]:
    """A kept item as the Responses API lists it (its ``ResponseItem`` shape): a message's text parts as
    ``input_text`` (``output_text`` in an assistant turn), with its status (an output item's own, else completed)."""
    fields = item.model_dump(exclude_none=True)
    if item.type == "message":
        text_type = "output_text" if item.role == "assistant" else "input_text"
        parts = [InputPart(type=text_type, text=item.content)] if isinstance(item.content, str) else item.content or []
        fields["content"] = [
            part.model_dump(exclude_none=True) | ({"annotations": []} if part.type == "output_text" else {})
            for part in parts
        ]
    if item.type == "reasoning":
        fields["summary"] = []
    return {"status": "completed"} | fields
