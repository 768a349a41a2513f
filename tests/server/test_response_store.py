"""The Responses API's store (``previous_response_id``): the least recently used responses go first, past a count
or past a size of their own text; a kept conversation is what the response was given, then its output."""

from __future__ import annotations

import pytest

from xinfer.server.errors import APIError
from xinfer.server.responses_api.objects import FunctionCallItem, OutputMessage, OutputText, Response
from xinfer.server.responses_api.protocol import InputItem
from xinfer.server.responses_api.store import ResponseStore


def answered(response_id: str, text: str) -> Response:
    message = OutputMessage(id=f"msg_{response_id}", status="completed", content=[OutputText(text=text)])
    return Response(id=response_id, created_at=0, status="completed", model="m", output=[message])


def ask(text: str) -> list[InputItem]:
    return [InputItem(role="user", content=text)]


def kept(store: ResponseStore) -> list[str]:
    found = []
    for response_id in ("a", "b", "c", "d"):
        try:
            store.get(response_id)
            found.append(response_id)
        except APIError:
            pass
    return found


def test_the_least_recently_used_go_first_past_the_count():
    store = ResponseStore(capacity=2)
    store.keep(answered("a", "1"), [], ask("x"))
    store.keep(answered("b", "2"), [], ask("y"))
    store.conversation("a")  # continued: used last
    store.keep(answered("c", "3"), [], ask("z"))
    assert kept(store) == ["a", "c"]


def test_past_the_size_of_their_own_text_the_oldest_go():
    store = ResponseStore(max_bytes=20)
    store.keep(answered("a", "12345"), [], ask("12345"))  # 10 characters
    store.keep(answered("b", "1234567"), store.conversation("a"), ask("123"))  # its own: 10, not the 20 it was given
    assert kept(store) == ["a", "b"]
    store.keep(answered("c", "1"), [], ask("1"))  # 22 in all: "a" goes
    assert kept(store) == ["b", "c"]
    store.delete("b")
    with pytest.raises(APIError) as error:
        store.conversation("b")
    assert error.value.status == 400 and error.value.param == "previous_response_id"


def test_a_conversation_is_the_input_then_the_output_as_items_given_back():
    store = ResponseStore()
    call = FunctionCallItem(id="fc_1", call_id="call_1", name="f", arguments="{}", status="completed")
    response = answered("a", "hi")
    response.output.append(call)
    store.keep(response, [], ask("q"))
    question, message, function_call = store.conversation("a")
    assert (question.role, question.content) == ("user", "q")
    assert (message.type, message.role, [(p.type, p.text) for p in message.content]) == (
        "message", "assistant", [("output_text", "hi")],
    )  # fmt: skip
    assert (function_call.type, function_call.call_id, function_call.name, function_call.arguments) == (
        "function_call", "call_1", "f", "{}",
    )  # fmt: skip
