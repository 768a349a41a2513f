"""What every tool-call parser shares: the parsed shapes, the parser interface, and the
one streaming algorithm that all formats use.

A format is described by its markers (``starts``, ``end``) and one function,
:meth:`ToolParser.calls`, that reads the calls of a block of text (from a start marker
on, without its end marker), complete or still growing. Whole outputs and streams both go
through :class:`ToolCallStream`, so the deltas of a stream cut anywhere concatenate to the
whole output's parse as long as ``calls`` is monotone (a growing block's calls keep their
names, and each call's arguments only grow, every partial value a prefix of the final one)
and the calls are well formed: a stream cannot take back a call that turns out malformed,
a whole output with one is text.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


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
    # start markers that are also ordinary text: the block they open is held until the output ends
    tentative_starts: ClassVar[tuple[str, ...]] = ()
    keeps_special_tokens: ClassVar[bool] = False  # the markers are special tokens: decode them
    # a closed block whose calls are not each a name and a JSON object is text (False: the calls as read)
    checks_calls: ClassVar[bool] = True

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
        """A whole output's content and tool calls: as vLLM's ``extract_tool_calls``, the text
        before the first call (None where there is none) and the calls, or the whole output
        as content where a block of calls is malformed or cut off."""
        stream = self.stream()
        content = stream.push(text).content + stream.finish().content
        if stream.broken or not stream.calls:
            return ParsedOutput(text, [])
        return ParsedOutput(content or None, stream.calls)

    def stream(self, hold: bool = False) -> ToolCallStream:
        """A parser of one output fed as text deltas (``hold``: see :class:`ToolCallStream`)."""
        return ToolCallStream(self, hold)

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

    As vLLM's parsers answer a whole output, the content is the text before the first
    block of calls, as written, and text after a block is not content. Text that may
    still become a start marker is held back until a later delta settles it. A block
    whose calls are malformed or cut off is text where none of its calls went out yet;
    after calls went out it breaks the stream (:attr:`broken`), and :meth:`ToolParser.parse`
    answers such an output as text. ``hold``: a block's calls go out only once it closed
    and they all proved valid, so that every call streamed is one the whole output holds."""

    def __init__(self, parser: ToolParser, hold: bool = False):
        self.parser = parser
        self.hold = hold
        self.calls: list[ToolCall] = []  # calls as far as they were emitted
        self.pending = ""  # text not settled yet
        self.marker: str | None = None  # the open block's start marker
        self.block_first = 0  # index of the open block's first call
        self.markers_off = False  # no block opens any more (see _not_a_block, and at_start_only)
        self.broken = False  # a block failed after calls went out: the rest is dropped

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
        while not self.broken:
            if self.marker is not None:
                if not self._block(out, final):
                    return
                continue
            if not self._content_until_block(out, final):
                return
        self.pending = ""

    def _content_until_block(self, out: StreamDelta, final: bool) -> bool:
        """Emits content up to the next start marker; True where a block opens there."""
        text, starts = self.pending, self.parser.starts
        if not self.markers_off and self.parser.at_start_only:
            stripped = text.lstrip()
            marker = next((m for m in starts if stripped.startswith(m)), None)
            # an empty marker (a block that is the whole output) waits for the output's first text: while a
            # model reasons no answer text comes, and its call must not open before the reasoning ends
            if marker is not None and (stripped or final):
                return self._open(out, stripped, "", marker)  # blanks before a call are no content
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
                self._content(text[: len(text) - keep], out)
                return False
        self.pending = ""
        self._content(text, out)
        return False

    def _open(self, out: StreamDelta, block: str, before: str, marker: str) -> bool:
        self._content(before, out)
        self.pending, self.marker, self.block_first = block, marker, len(self.calls)
        return True

    def _block(self, out: StreamDelta, final: bool) -> bool:
        """Emits the open block's calls; True where the block closed (the rest is scanned again)."""
        block, rest, closed = self._split_block(final)
        if not closed and (self.hold or self.marker in self.parser.tentative_starts):
            return False
        try:
            calls = self.parser.calls(block, final=closed)
            if closed and self.parser.checks_calls:
                _check(calls)
        except NotToolCalls:
            if self.calls:
                self.broken = True
                return False
            return self._not_a_block()
        self._emit(calls, out)
        if closed:
            self.pending, self.marker = rest, None
            self.markers_off = self.parser.at_start_only  # such a block opens the output only
        return closed

    def _split_block(self, final: bool) -> tuple[str, str, bool]:
        """(the open block without its end marker, the text after it, whether it closed)."""
        end, text, start = self.parser.end, self.pending, len(self.marker or "")
        index = self.parser.find_end(text, start)
        if index < 0 and final and end:
            index = text.find(end, start)  # an end marker that find_end took for a value's text is the end after all
        if index >= 0:
            return text[:index], text[index + len(end or "") :], True
        if final:
            return text, "", True
        return text[: len(text) - (_partial_suffix(text, end) if end else 0)], "", False

    def _not_a_block(self) -> bool:
        """A block that is ordinary text: it and the rest of the output are content (vLLM answers an
        output with a block it cannot read as text)."""
        self.marker, self.markers_off = None, True
        return True

    def _content(self, text: str, out: StreamDelta) -> None:
        if not self.calls:  # text after calls is no content (vLLM's whole answers drop it)
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


def _check(calls: list[PartialCall]) -> None:
    """Raises NotToolCalls unless every call of a closed block has a name and a JSON object
    of arguments (vLLM answers a call it cannot ``json.loads`` as text)."""
    for call in calls:
        if call.name is None or not is_json_object(call.arguments):
            raise NotToolCalls(f"the arguments of {call.name!r} are not a JSON object: {call.arguments!r}")


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


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
