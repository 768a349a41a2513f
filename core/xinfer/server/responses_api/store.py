"""Responses kept for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``, as OpenAI keeps them
(``store``, true by default): in memory, the last :data:`CAPACITY` used and at most :data:`MAX_BYTES` of their own
text (images' data URLs included), lost when the server stops.

A kept response holds its conversation as input items: the items it was given (those of the response it
continued first) and its own output as the items a client would give back (its message as an assistant
message, its reasoning, its function calls), so that continuing it is giving the model all of them again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from xinfer.server.errors import APIError, bad_request
from xinfer.server.responses_api.objects import FunctionCallItem, OutputItem, OutputMessage, Response
from xinfer.server.responses_api.protocol import InputItem, InputPart

CAPACITY = 1000
MAX_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Kept:
    response: Response
    conversation: list[InputItem]
    size: int  # the characters of its own input and output (those of the response it continues are that one's)


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY, max_bytes: int = MAX_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._size = 0

    def keep(self, response: Response, previous: list[InputItem], own: list[InputItem]) -> None:
        """``previous``: the conversation of the response it continued; ``own``: its request's input items."""
        mine = [*own, *(as_input(item) for item in response.output)]
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
        kept = self._kept.get(response_id)
        if kept is None:
            raise APIError(404, f"no response with id {response_id!r} is kept", param="response_id", code="not_found")
        return kept.response

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._size -= self._kept.pop(response_id).size


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
        return InputItem(type="message", role="assistant", content=parts)
    if isinstance(item, FunctionCallItem):
        return InputItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments)
    return InputItem(
        type="reasoning", content=[InputPart(type="reasoning_text", text=part.text) for part in item.content]
    )
