"""Chat templates, rendered the way transformers' ``apply_chat_template`` renders them.

Templates come from model files and are untrusted code (CVE-2024-34359), so they run only
in jinja2's ``ImmutableSandboxedEnvironment``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that fails while rendering."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters and sorts keys; HF templates expect neither
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``, which marks the assistant's text for training masks: its body
    renders as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _plain(value: Any) -> Any:
    """JSON-like data only: the template must not reach methods of caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # subclasses (str enums, int enums, numpy floats, ...) carry extra methods: back to the base type
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (int, float)):
        return int(value) if isinstance(value, int) else float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# the names a message's reasoning comes under; templates read reasoning_content, gpt-oss's thinking
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _message(message: Any) -> dict[str, Any]:
    # keys set to None (OpenAI clients send content=None, tool_calls=None) are dropped, as
    # transformers does: templates test for a key's presence, not for None
    plain = _plain(message)
    if not isinstance(plain, dict):
        raise ChatTemplateError(f"a chat message must be a mapping, got {type(message).__name__}")
    plain = {k: v for k, v in plain.items() if v is not None}
    # reasoning under any of its names is there under both names templates read, in transformers' key order
    reasoning = next((plain[k] for k in _REASONING_KEYS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


class ChatTemplate:
    """A compiled chat template; ``origin`` names where it came from in every error. ``special_tokens``: the
    variables transformers gives every template, the tokenizer's special tokens by role (``bos_token``,
    ``eos_token``, ``unk_token``, ``pad_token``, ...).

    ``content_format``: how the template reads a message's content, as vLLM's "auto" detects it: "openai" where
    it loops over a message's content (a list of parts), else "string" (text parts joined by newlines)."""

    def __init__(self, source: str, origin: str, special_tokens: Mapping[str, Any] | None = None):
        self.source, self.origin = source, origin
        self.special_tokens = {name: token for name, token in (special_tokens or {}).items() if token is not None}
        environment = _environment()
        try:
            self._template = environment.from_string(source)
            self.content_format = "openai" if _loops_over_content(environment.parse(source)) else "string"
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template from {origin} does not compile: {_describe(e)}") from e

    def render(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """``continue_final_message``: the text ends with the final message's, which the model goes on with."""
        plain = [_message(m) for m in messages]
        if not continue_final_message:
            return self._render(plain, add_generation_prompt, tools, documents, extra)
        # as transformers does: a tag after the final text, then the text cut where the tag is
        if "content" not in self.source:
            raise ChatTemplateError(f"chat template from {self.origin} does not write messages' content")
        plain, final = _tag_final_message(plain)
        text = self._render(plain, add_generation_prompt, tools, documents, extra)
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ChatTemplateError(f"chat template from {self.origin} does not write the final message's text")
        at = text.rindex(_CONTINUE_TAG.strip())
        # a template that trims the message trims the space after it too
        return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Any] | None,
        documents: Sequence[Any] | None,
        extra: dict[str, Any],
    ) -> str:
        context = {**self.special_tokens, **_plain(extra)}
        try:
            return self._template.render(
                messages=messages,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # the template is code: whatever it raises is its failure
            raise ChatTemplateError(f"chat template from {self.origin} failed: {_describe(e)}") from e

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r})"


def _loops_over_content(template: jinja2.nodes.Template) -> bool:
    """Whether a ``for`` loop of ``template`` goes over some ``X.content`` / ``X['content']`` (through filters,
    or through a variable set to it)."""

    def content_of(node: jinja2.nodes.Node | None, names: set[str]) -> bool:
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
            node = node.node
        if isinstance(node, jinja2.nodes.Name):
            return node.name in names
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == "content"
        return isinstance(node, jinja2.nodes.Getitem) and getattr(node.arg, "value", None) == "content"

    names = {
        target.name
        for assign in template.find_all(jinja2.nodes.Assign)
        if isinstance(target := assign.target, jinja2.nodes.Name) and content_of(assign.node, set())
    }
    return any(content_of(loop.iter, names) for loop in template.find_all(jinja2.nodes.For))


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The messages with the tag after the final message's text (its last text part), and that text."""
    final = dict(messages[-1]) if messages else {}
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return [*messages[:-1], final], content
    parts = content if isinstance(content, list) else []
    last = next((i for i in reversed(range(len(parts))) if isinstance(parts[i], dict) and "text" in parts[i]), None)
    if last is None:
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    text = parts[last]["text"]
    final["content"] = [*parts[:last], {**parts[last], "text": f"{text}{_CONTINUE_TAG}"}, *parts[last + 1 :]]
    return [*messages[:-1], final], text


def _describe(e: Exception) -> str:
    line = getattr(e, "lineno", None)
    where = f" (line {line})" if line else ""
    return f"{type(e).__name__}: {e}{where}"
