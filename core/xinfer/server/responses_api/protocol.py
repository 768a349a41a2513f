"""Request bodies of OpenAI's Responses API.

Parsed as the other bodies are (strict JSON), except that a field this server does not
implement is refused, naming it (:func:`unsupported_field`), where the chat routes ignore
unknown fields: ignoring ``conversation`` would change the answer without saying so.
Fields that only change bookkeeping are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from xinfer.server.errors import FieldError
from xinfer.server.protocol import FORMAT_NAME, MAX_TOP_LOGPROBS, ReasoningEffort, RequestBody, asks_nothing
from xinfer.server.responses_api.objects import ItemStatus

# fields accepted and not read: they change no answer (the server runs no tool); those the response repeats are
# ResponsesRequest's own fields
IGNORED_FIELDS = frozenset({"prompt_cache_options", "service_tier", "stream_options"})
# the values of other fields that ask for nothing beyond what this server does (their defaults)
NEUTRAL_VALUES = {"truncation": ("disabled",)}
# OpenAI's limits on metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512
MAX_METADATA_PAIRS = 16
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# OpenAI's values of include (its ResponseIncludable); all but OUTPUT_LOGPROBS are accepted and ignored: the
# outputs of hosted tools this server does not run, input image URLs of a response it does not store, and
# encrypted reasoning, which it does not keep (its reasoning items carry their text, read back from there)
INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url",
              "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "code_interpreter_call.outputs", "computer_call_output.output.image_url")  # fmt: skip


class InputPart(RequestBody):
    """A part of an input message's content: ``input_text`` (``output_text`` or ``refusal`` in an assistant
    turn given back), or ``input_image`` with an ``image_url``."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputItem(RequestBody):
    """An item of ``input``: a message (``type`` ``message`` or absent); a ``function_call`` the
    model made (``call_id``, ``name``, ``arguments``) and its ``function_call_output``
    (``call_id``, ``output``); or a ``reasoning`` item given back (its ``content``'s text). ``id``: an output
    item's given back, or one the store gives it; ``status``: an output item's (the model reads neither)."""

    id: str | None = None
    status: ItemStatus | None = None
    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FORMAT_NAME)  # required for json_schema, as OpenAI's
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _has_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("schema", "text.format of type json_schema needs a schema")
        if self.type == "json_schema" and self.name is None:
            raise FieldError("name", "text.format of type json_schema needs a name")
        return self


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(RequestBody):
    effort: ReasoningEffort | None = None
    summary: str | None = None  # not written: the reasoning item carries the reasoning's text itself


class ResponsesRequest(RequestBody):
    # unknown fields are kept, to name the first unsupported one (a ``null`` one is left out, as elsewhere)
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)  # (OpenAI's least is 16; vLLM's 1, as here)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives of each output_text token
    store: bool = True  # kept for previous_response_id and GET /v1/responses/{id} (responses_api/store.py)
    previous_response_id: str | None = None
    # bookkeeping: not read, repeated on the response
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    max_tool_calls: int | None = None

    @field_validator("include")
    @classmethod
    def _includable(cls, include: list[str] | None) -> list[str] | None:
        unknown = next((value for value in include or [] if value not in INCLUDABLE), None)
        if unknown is not None:
            raise ValueError(f"{unknown!r} is not one of {', '.join(INCLUDABLE)}")
        return include

    def input_items(self) -> list[InputItem]:
        """``input`` as items (a string: one user message)."""
        return [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    @property
    def output_logprobs(self) -> bool:
        """Whether the message's ``output_text`` carries its tokens' logprobs."""
        return OUTPUT_LOGPROBS in (self.include or [])

    def unsupported_field(self) -> str | None:
        """The first field the body sets that this server does not implement."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_FIELDS or asks_nothing(value, NEUTRAL_VALUES.get(name, ())):
                continue
            return name
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            return "text.verbosity"
        return None
