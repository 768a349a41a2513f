"""Request bodies of the HTTP API (OpenAI's shapes plus vLLM's common extras).

Bodies are parsed in pydantic's strict JSON mode: a string where a number belongs
is an error, not a guess. Unknown fields are ignored, as OpenAI clients send new
ones before servers know them (OpenAI's fields asking for what this server does not do are
refused: ``UNSUPPORTED_CHAT_FIELDS``), and ``null`` in a field that has a default means that
default, as OpenAI's schema lets most fields be null (the clients send an explicit None). Bounds on ``n``, logprobs and stop strings keep
one request from costing the server more than a client should be able to ask.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from xinfer.sampling import truncated
from xinfer.server.errors import FieldError, bad_request
from xinfer.server.tools import check_tool_choice, check_tools

MAX_N = 128  # OpenAI's bound
FORMAT_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # a json_schema format's name, as OpenAI checks it
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_EMBEDDING_INPUTS = 256
INT64 = 2**63

StopStrings = str | list[str] | None


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        required = _required_keys(cls)
        return {key: value for key, value in data.items() if value is not None or key in required}


@functools.cache
def _required_keys(body: type[RequestBody]) -> frozenset[str]:
    return frozenset(field.alias or name for name, field in body.model_fields.items() if field.is_required())


class ImageURL(RequestBody):
    url: str
    detail: str | None = None


class ContentPart(RequestBody):
    """A part of a message's content: ``{"type": "text", "text": ...}``, ``{"type": "image_url",
    "image_url": {"url": ...}}``, or one vLLM reads as text (:data:`~xinfer.text.chat_messages.TEXT_PART_FIELDS`:
    an assistant's ``{"type": "refusal", "refusal": ...}``, ``input_text``, ``thinking``, ...)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    refusal: str | None = None
    thinking: str | None = None


class CalledFunction(RequestBody):
    name: str
    arguments: str  # JSON text as the model wrote it: text that is not JSON is kept, as OpenAI keeps it


class AssistantToolCall(RequestBody):
    """A call in an assistant turn given back: OpenAI's function call (this server runs no custom tools), whose
    ``type`` OpenAI requires."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's name of reasoning_content, read as it
    refusal: str | None = None  # an assistant's refusal given back: what it said, where content is null
    function_call: dict[str, Any] | None = None  # the deprecated form of tool_calls: refused

    @model_validator(mode="after")
    def _reasoning_under_either_name(self) -> ChatMessage:
        if self.reasoning_content is None:
            self.reasoning_content = self.reasoning
        return self

    @field_validator("tool_call_id")
    @classmethod
    def _tool_result_names_its_call(cls, tool_call_id: str | None, info: ValidationInfo) -> str | None:
        if tool_call_id is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return tool_call_id

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.function_call is not None:
            raise FieldError("function_call", "the deprecated function_call is not supported: give tool_calls")
        if self.content is None and self.role == "assistant" and self.refusal is not None:
            self.content = self.refusal
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("content", f"a message of role {self.role!r} needs content")
        if self.content == []:  # OpenAI's: content parts are a list of at least one
            raise FieldError("content", "content must be a string or a list of at least one part, got []")
        return self


def check_tool_turns(messages: list[ChatMessage]) -> None:
    """OpenAI's pairing of calls and results: the tool messages right after an assistant turn's ``tool_calls``
    answer each of its calls, and a tool message answers one of them."""
    calls: list[str] = []  # the ids of the calls that the tool messages now read answer
    answered: set[str] = set()
    caller = 0
    for i, message in enumerate([*messages, None]):  # None: the end, where the last calls must be answered
        if message is not None and message.role == "tool":
            call_id = message.tool_call_id
            if call_id is None or call_id not in calls:
                raise FieldError(f"messages.{i}", f"a tool message must answer a call of the assistant message "
                                 f"before it, and none there has the id {call_id!r}")  # fmt: skip
            answered.add(call_id)
            continue
        missing = [call for call in calls if call not in answered]
        if missing:
            raise FieldError(f"messages.{caller}", "an assistant message with tool_calls must be followed by tool "
                             f"messages answering each call; none answers {', '.join(missing)}")  # fmt: skip
        calls = [call.id for call in message.tool_calls or []] if message is not None else []
        answered, caller = set(), i


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(RequestBody):
    name: str = Field(pattern=FORMAT_NAME)  # required, as OpenAI's and vLLM's
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _has_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise FieldError("json_schema", "response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputsBody(RequestBody):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# vLLM's former names of structured_outputs' constraints, which clients still send
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def check_stop_strings(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
        raise ValueError(f"stop strings must have 1 to {MAX_STOP_LENGTH} characters")


# OpenAI's values (a template that reads reasoning_effort gets the value as given; "none" turns thinking off)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# OpenAI's chat fields that ask for what this server does not do (audio output, moderation, web search, a
# verbosity other than the model's own, the deprecated functions): a 400 naming them unless they hold no more
# than what it does anyway (None, or the values below), as ignoring them would answer what was not asked for
UNSUPPORTED_CHAT_FIELDS = {
    "audio": "audio output is not supported: answers are text",
    "modalities": 'only ["text"] is supported: answers are text',
    "moderation": "moderation is not run by this server",
    "web_search_options": "web search is not run by this server",
    "verbosity": "only 'medium' is supported: the model's answers are as long as it makes them",
    "functions": "the deprecated functions are not supported: give them as tools",
    "function_call": "the deprecated function_call is not supported: give tool_choice",
    # vLLM's extra: the image processor is built once, from the server's --mm-processor-kwargs
    "mm_processor_kwargs": "image processor settings are the server's, not a request's: start it with "
    "--mm-processor-kwargs",
}
NEUTRAL_CHAT_VALUES: dict[str, tuple[Any, ...]] = {"modalities": (["text"],), "verbosity": ("medium",),
                                                   "functions": ([],), "mm_processor_kwargs": ({},)}  # fmt: skip


def asks_nothing(value: Any, neutral: tuple[Any, ...] = ()) -> bool:
    """Whether a field's value asks for nothing: unset, empty, false, or one of ``neutral`` (what is done anyway)."""
    return value in (None, False, [], {}) or value in neutral


class SamplingFields(RequestBody):
    """What chat and completion requests share: the model, sampling, and stopping."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=INT64)
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: StopStrings = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1)  # vLLM's: the only tokens it may generate
    bad_words: list[str] | None = None  # vLLM's: words it never generates
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep a prompt's last tokens (-1: as many as the context holds)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: score each prompt token
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>", not by their text
    return_token_ids: bool = False  # vLLM's: the answer carries the prompt's and each choice's token ids
    # the fields a client set the token limit and the prompt by, for errors (a route that translates its own body
    # renames them)
    _token_limit_name: str = PrivateAttr("max_tokens")
    _prompt_name: str = PrivateAttr("prompt")
    _format_name: str = PrivateAttr("response_format")
    # the token limit of a request that gives none (None: the rest of the context), unless --max-tokens is set
    default_max_tokens: ClassVar[int | None] = None

    @property
    def token_limit_name(self) -> str:
        return self._token_limit_name

    @property
    def prompt_name(self) -> str:
        return self._prompt_name

    @property
    def format_name(self) -> str:
        return self._format_name

    @model_validator(mode="before")
    @classmethod
    def _guided_as_structured_outputs(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(data.get(name) is not None for name in GUIDED_FIELDS):
            return data
        if data.get("structured_outputs") is not None:
            raise FieldError("structured_outputs", "give structured_outputs or the guided_* fields, not both")
        guided = {GUIDED_FIELDS[name]: data[name] for name in GUIDED_FIELDS if data.get(name) is not None}
        return {key: value for key, value in data.items() if key not in GUIDED_FIELDS} | {"structured_outputs": guided}

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        # vLLM's rule, read on the body as sent: stream_options that are empty ({}) ask for nothing
        if isinstance(data, dict) and data.get("stream_options") and data.get("stream") is not True:
            raise FieldError("stream_options", "stream_options needs stream=true")
        return data

    @model_validator(mode="after")
    def _check_shared(self) -> SamplingFields:
        if self.structured_outputs is not None and self.response_format not in (None, ResponseFormat(type="text")):
            raise FieldError("structured_outputs", "give response_format or structured_outputs, not both")
        if self.prompt_logprobs and self.stream:  # vLLM's rule: they come with the whole answer only
            raise FieldError("prompt_logprobs", "prompt_logprobs are not available with stream=true")
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: StopStrings) -> StopStrings:
        check_stop_strings([stop] if isinstance(stop, str) else stop or [])
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # isdecimal, not isdigit: int() reads every decimal digit ("٣"), and no other ("²")
        if bias and not all(key.isdecimal() for key in bias):
            raise ValueError(f"logit_bias keys must be token ids, got {next(k for k in bias if not k.isdecimal())!r}")
        if bias and not all(-100 <= value <= 100 for value in bias.values()):  # OpenAI's range
            raise ValueError(f"logit_bias values must be in [-100, 100], got {max(bias.values(), key=abs)}")
        return bias

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, words: list[str] | None) -> list[str] | None:
        if words and not all(word.strip() for word in words):
            raise ValueError("bad_words must not be empty or blank")
        return words

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncation(cls, keep: int | None) -> int | None:
        if keep is not None and keep < 1 and keep != -1:
            raise ValueError("truncate_prompt_tokens must be -1 (the context) or at least 1")
        return keep

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """A prompt as ``truncate_prompt_tokens`` cuts it: its last tokens (more than the context holds: a 400, as
        vLLM's)."""
        keep = self.truncate_prompt_tokens
        if keep is not None and keep > max_model_len:
            raise bad_request(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                              f"({max_model_len}). Please, select a smaller truncation size.",
                              param="truncate_prompt_tokens")  # fmt: skip
        return truncated(token_ids, keep, max_model_len)

    def returned_ids(self, token_ids: list[int]) -> list[int] | None:
        """``token_ids`` where vLLM's ``return_token_ids`` asks for them, else None (left out of the answer)."""
        return token_ids if self.return_token_ids else None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (with ``include_usage``, as vLLM reads it): every streamed chunk carries
        the usage so far."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(SamplingFields):
    _prompt_name: str = PrivateAttr("messages")
    # where a route translated its own body into this one: the fields its images came from, in order
    _image_fields: list[str] | None = PrivateAttr(None)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # xinfer's extra: offer the tools of the --mcp-* servers (true: all of them; a list: those named)
    mcp: bool | list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, problem in UNSUPPORTED_CHAT_FIELDS.items():
                # web_search_options: {} asks for a search: only null (or a field left out) asks for nothing
                if data.get(name) not in (None, *NEUTRAL_CHAT_VALUES.get(name, ())):
                    raise FieldError(name, problem)
        return data

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.tools is not None:
            check_tools(self.tools)
        if not self.mcp:  # else checked once the MCP servers' tools are added
            check_tool_choice(self.tool_choice, self.tools)
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt=false")
        check_tool_turns(self.messages)
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def token_limit_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else self._token_limit_name

    def with_image_fields(self, urls: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The messages' image URLs with the fields of the client's own body they came from."""
        if self._image_fields is None:
            return urls
        return [(url, field) for (url, _), field in zip(urls, self._image_fields, strict=True)]

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


def prompt_list(prompt: Prompt) -> list[str | list[int]]:
    """The prompts of a completion or embedding request, each a string or token ids (a list of ids is one)."""
    one = isinstance(prompt, str) or all(isinstance(p, int) for p in prompt)
    return cast("list[str | list[int]]", [prompt] if one else prompt)


class CompletionRequest(SamplingFields):
    default_max_tokens: ClassVar[int] = 16  # OpenAI's legacy completions (and vLLM's) stop there unless told

    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompts alone, scored with logprobs (vLLM's)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.prompt == [] or self.prompt == [[]]:
            raise FieldError("prompt", "prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens 0 needs echo=true (the prompt given back alone)")
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", f"best_of is not supported (it may only equal n, {self.n}), got {self.best_of}")
        return self

    @property
    def num_prompts(self) -> int:
        return len(prompt_list(self.prompt))

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


GenerationRequest = ChatCompletionRequest | CompletionRequest


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    pooling: Literal["mean", "last"] = "mean"
    normalize: bool = True
    user: str | None = None

    @model_validator(mode="after")
    def _check_inputs(self) -> EmbeddingRequest:
        if self.input in ("", [], [[]]):
            raise FieldError("input", "input must not be empty")
        if (count := len(prompt_list(self.input))) > MAX_EMBEDDING_INPUTS:  # (a list of token ids is one)
            raise FieldError("input", f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {count}")
        return self


class TokenizeRequest(RequestBody):
    """A prompt, or chat messages rendered as ``/v1/chat/completions`` renders them (vLLM's fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError(
                "prompt" if self.messages is None else "messages", "give exactly one of prompt or messages"
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt=false")
        if self.tools is not None:
            check_tools(self.tools)
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
