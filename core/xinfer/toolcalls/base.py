"""What every tool-call parser shares: the parsed shapes, the parser interface, and the
one streaming algorithm that all formats use.

A format is described by its markers (``starts``, ``end``) and one function,
:meth:`ToolParser.calls`, that reads the calls of a block of text (from a start marker
on, without its end marker), complete or still growing. Whole outputs and streams both go
through :class:`ToolCallStream`, so the deltas of a stream cut anywhere concatenate to the
whole output's parse as long as ``calls`` is monotone: a growing block's calls keep their
names, and each call's arguments only grow (every partial value a prefix of the final one).
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

WHITESPACE = " \t\r\n"


@dataclass
class ToolCall:
    """A call the model asked for: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A whole output: its text outside tool calls (None where only calls were written) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its first piece carries ``id`` and ``name``, later ones
    only more ``arguments`` text (OpenAI's streamed shape)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one pushed text delta settles: answer text and pieces of tool calls."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is written: ``name`` None until the name is complete; ``arguments``
    the JSON text of the arguments so far (a prefix of its final value)."""

    name: str | None
    arguments: str = ""


class NotToolCalls(ValueError):
    """Raised by :meth:`ToolParser.calls` when a block turns out not to hold tool calls
    (a start marker that is also ordinary text, e.g. ``[`` or ``{``): it is answer text."""


class ToolParser(ABC):
    """Reads one family's tool calls out of a model's output.

    ``tools`` (OpenAI's ``tools`` list) lets formats that write argument values as plain
    text convert them by the parameters' JSON schema types."""

    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]]  # markers that open a block of calls
    end: ClassVar[str | None] = None  # marker that closes it (None: the output's end)
    at_start_only: ClassVar[bool] = False  # a block may only open the output
    keeps_special_tokens: ClassVar[bool] = False  # the markers are special tokens: decode them

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.tools = tools or []

    @abstractmethod
    def calls(self, block: str, final: bool) -> list[PartialCall]:
        """The calls in ``block`` (text from a start marker on, its end marker cut off);
        ``final``: the block is complete. Raises :class:`NotToolCalls` for a block that
        is ordinary text."""

    def find_end(self, text: str, start: int) -> int:
        """Where the end marker of the block in ``text`` is, searching from ``start`` (-1: not written yet)."""
        return text.find(self.end, start) if self.end else -1

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's content and tool calls."""
        stream = self.stream()
        deltas = [stream.push(text), stream.finish()]
        content = "".join(d.content for d in deltas)
        if stream.calls and not content:
            return ParsedOutput(None, stream.calls)
        return ParsedOutput(content, stream.calls)

    def stream(self) -> ToolCallStream:
        """A parser of one output fed as text deltas."""
        return ToolCallStream(self)

    def parameters(self, function: str) -> dict[str, Any]:
        """The JSON schemas of ``function``'s parameters, by name (empty when unknown)."""
        for tool in self.tools:
            described = tool.get("function", tool) if isinstance(tool, dict) else {}
            if isinstance(described, dict) and described.get("name") == function:
                schema = described.get("parameters") or described.get("input_schema") or {}
                properties = schema.get("properties") if isinstance(schema, dict) else None
                return properties if isinstance(properties, dict) else {}
        return {}


class ToolCallStream:
    """Splits an output, pushed as text deltas, into answer text and tool-call deltas.

    Text that may still become a start marker, and the blanks before one, are held back
    until a later delta settles them; blanks right before and after a block of calls are
    dropped (so that an output of calls alone has no content)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.calls: list[ToolCall] = []  # calls as far as they were emitted
        self.pending = ""  # text not settled yet
        self.in_block = False
        self.marker_length = 0  # of the open block's start marker
        self.block_first = 0  # index of the open block's first call
        self.markers_off = False  # a start-only format whose output began with text
        self.after_block = False  # a block just closed: the next blanks are dropped
        self.held_space = ""  # trailing blanks of the content, held back
        self.dropped_space = ""  # the blanks before the open block (content again if it is not one)

    def push(self, delta: str) -> StreamDelta:
        self.pending += delta
        out = StreamDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> StreamDelta:
        """What is still held, once the output ends."""
        out = StreamDelta()
        self._advance(out, final=True)
        return out

    def _advance(self, out: StreamDelta, final: bool) -> None:
        while True:
            if self.in_block:
                if not self._block(out, final):
                    return
                continue
            if not self._content_until_block(out, final):
                return

    def _content_until_block(self, out: StreamDelta, final: bool) -> bool:
        """Emits content up to the next start marker; True where a block opens there."""
        text, starts = self.pending, self.parser.starts
        if not self.markers_off and self.parser.at_start_only:
            stripped = text.lstrip()
            marker = next((m for m in starts if stripped.startswith(m)), None)
            if marker is not None:
                blanks = len(text) - len(stripped)
                return self._open(out, text[blanks:], text[:blanks], marker)
            if not final and any(m.startswith(stripped) for m in starts):
                return False  # blanks, or the beginning of a marker: wait
            self.markers_off = True
        if not self.markers_off and not self.parser.at_start_only:
            found = [(i, m) for m in starts if (i := text.find(m)) >= 0]
            if found:
                index, marker = min(found)
                return self._open(out, text[index:], text[:index], marker)
            if not final:
                keep = max((_partial_suffix(text, m) for m in starts), default=0)
                self.pending = text[len(text) - keep :]
                self._content(text[: len(text) - keep], out, final)
                return False
        self.pending = ""
        self._content(text, out, final)
        return False

    def _open(self, out: StreamDelta, block: str, before: str, marker: str) -> bool:
        self._content(before, out, final=False)
        self.dropped_space, self.held_space = self.held_space, ""  # blanks before a block are dropped
        self.pending, self.in_block, self.marker_length = block, True, len(marker)
        self.block_first = len(self.calls)
        return True

    def _block(self, out: StreamDelta, final: bool) -> bool:
        """Emits the open block's calls; True where the block closed (the rest is content again)."""
        end, text = self.parser.end, self.pending
        index = self.parser.find_end(text, self.marker_length)
        if index >= 0:
            block, rest, closed = text[:index], text[index + len(end or "") :], True
        elif final:
            block, rest, closed = text, "", True
        else:
            block, rest, closed = text[: len(text) - (_partial_suffix(text, end) if end else 0)], "", False
        try:
            calls = self.parser.calls(block, final=closed)
        except NotToolCalls:
            if len(self.calls) > self.block_first:  # calls of this block already went out: keep them
                calls = []
            else:
                return self._not_a_block(out)
        self._emit(calls, out)
        if closed:
            self.pending, self.in_block, self.after_block = rest, False, True
            self.markers_off = self.parser.at_start_only  # such a block opens the output only
        return closed

    def _not_a_block(self, out: StreamDelta) -> bool:
        """A block that is ordinary text: its marker is content, and scanning goes on after it."""
        self.in_block, self.held_space = False, self.dropped_space
        if self.parser.at_start_only:
            self.markers_off = True
            return True
        marker, self.pending = self.pending[: self.marker_length], self.pending[self.marker_length :]
        self._content(marker, out, final=False)
        return True

    def _content(self, text: str, out: StreamDelta, final: bool) -> None:
        if self.after_block:
            text = text.lstrip()
            if not text:
                return
            self.after_block = False
        text, self.held_space = self.held_space + text, ""
        if not final:
            body = text.rstrip(WHITESPACE)
            text, self.held_space = body, text[len(body) :]
        out.content += text

    def _emit(self, calls: list[PartialCall], out: StreamDelta) -> None:
        for offset, call in enumerate(calls):
            if call.name is None:
                return  # later calls wait for this one's name
            index = self.block_first + offset
            if index == len(self.calls):
                self.calls.append(ToolCall(self.parser.new_id(), call.name, call.arguments))
                out.tool_calls.append(ToolCallDelta(index, self.calls[index].id, call.name, call.arguments))
                continue
            sent = self.calls[index].arguments
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self.calls[index].arguments = call.arguments
                out.tool_calls.append(ToolCallDelta(index, arguments=call.arguments[len(sent) :]))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that begins ``marker`` (shorter than it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


ALPHANUMERIC = string.ascii_letters + string.digits


def short_id(length: int = 9) -> str:
    """A call id of letters and digits (Mistral's templates require nine)."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(length))
