"""Reasoning blocks (``<think> ... </think>``) split from the answer: whole, or as a stream
of text deltas cut anywhere.

Models that think (Qwen3, DeepSeek R1, GLM-4.5 and later, MiniMax-M2) write their
reasoning between two tags; some chat templates open the block in the prompt (DeepSeek
R1 writes ``<think>\\n`` after the assistant header), so the output may start inside
it. Whether it does is read from the rendered prompt (:func:`opens_reasoning`), not
from the model's name: the same parser serves every family. A block the template closes
in the prompt (Qwen3's ``enable_thinking=false``) leaves the whole output to the answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Qwen3.5 may open a tool call inside its reasoning without closing it: as vLLM's
# Qwen3ReasoningParser, a <tool_call> that a <function=...> follows ends the reasoning
QWEN_CALL = re.compile(r"<tool_call>\s*<function[\s=]")
QWEN_CALL_START, QWEN_FUNCTION = "<tool_call>", "<function"


@dataclass(frozen=True)
class ReasoningTags:
    start: str = "<think>"
    end: str = "</think>"


THINK = ReasoningTags()
# --reasoning-parser names (vLLM's, for the families that write <think> blocks)
PARSERS = {name: THINK for name in ("think", "deepseek_r1", "deepseek_v3", "qwen3", "glm45", "minimax_m2")}


def detect(tokenizer: Any) -> ReasoningTags | None:
    """The tags of a model that thinks: its chat template writes the end tag and its
    vocabulary has that tag as one token (so that a grammar can start after it)."""
    template = getattr(tokenizer, "chat_template", None)
    source = getattr(template, "source", None) or ""
    for tags in dict.fromkeys(PARSERS.values()):
        if tags.end in source and tokenizer.token_to_id(tags.end) is not None:
            return tags
    return None


def opens_reasoning(prompt: str, tags: ReasoningTags) -> bool:
    """Whether the prompt leaves a reasoning block open (the output starts inside it)."""
    return prompt.rfind(tags.start) > prompt.rfind(tags.end)


def split(text: str, tags: ReasoningTags, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output; reasoning is None where the output has none.
    ``inside``: the prompt opened the block (:func:`opens_reasoning`)."""
    stream = ReasoningStream(tags, inside)
    reasoning, content = stream.push(text)
    more_reasoning, more_content = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning if stream.seen else None), content


class ReasoningStream:
    """Splits text deltas into reasoning and answer deltas. A delta's tail that may be the
    start of a tag is held back until the next delta settles it."""

    def __init__(self, tags: ReasoningTags, inside: bool = False):
        self.tags = tags
        self.inside = inside  # in the reasoning block now
        self.seen = inside  # a reasoning block was opened
        self.at_start = not inside  # nothing of the answer written yet: a start tag may still come
        self.after_end = False  # the block just closed: the answer's leading blank lines are dropped
        self.pending = ""

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning, answer) text that ``delta`` settles."""
        text, self.pending = self.pending + delta, ""
        reasoning, content = [], []
        while text:
            if self.inside:
                stop, answer = _reasoning_end(text, self.tags.end)
                if stop >= 0:
                    reasoning.append(text[:stop])
                    text, self.inside, self.after_end = text[answer:], False, True
                    continue
                keep = max(_partial_suffix(text, self.tags.end), _partial_call(text))
                reasoning.append(text[: len(text) - keep])
                self.pending = text[len(text) - keep :]
                break
            if self.at_start:
                stripped = text.lstrip()
                if stripped.startswith(self.tags.start):
                    text = stripped[len(self.tags.start) :]
                    self.inside = self.seen = True
                    self.at_start = False
                    continue
                if self.tags.start.startswith(stripped):  # may still become the start tag
                    self.pending = text
                    break
                self.at_start = False
            if not self.seen:
                # an end tag the prompt did not open (vLLM's Qwen3 and DeepSeek-R1 parsers): what
                # comes before it is reasoning, as far as it is not sent as answer already
                index = text.find(self.tags.end)
                if index >= 0:
                    reasoning.append(text[:index])
                    text, self.seen, self.after_end = text[index + len(self.tags.end) :], True, True
                    continue
                keep = _partial_suffix(text, self.tags.end)
                text, self.pending = text[: len(text) - keep], text[len(text) - keep :]
            if self.after_end:
                text = text.lstrip()
                self.after_end = not text
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output ends."""
        text, self.pending = self.pending, ""
        if self.inside:
            return text, ""
        return "", text


def _reasoning_end(text: str, end: str) -> tuple[int, int]:
    """(where the reasoning in ``text`` stops, where the answer starts), or (-1, -1): the end
    tag, or a Qwen tool call that the model opened before it (the answer starts with it)."""
    index = text.find(end)
    call = QWEN_CALL.search(text, 0, index if index >= 0 else len(text))
    if call is not None:
        return call.start(), call.start()
    return (index, index + len(end)) if index >= 0 else (-1, -1)


def _partial_call(text: str) -> int:
    """The length of the tail of ``text`` that may still become a Qwen tool call's opening."""
    index = text.rfind(QWEN_CALL_START)
    if index >= 0 and QWEN_FUNCTION.startswith(text[index + len(QWEN_CALL_START) :].lstrip()):
        return len(text) - index
    return _partial_suffix(text, QWEN_CALL_START)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def reasoning_token_count(token_ids: list[int], start_id: int | None, end_id: int | None, inside: bool) -> int:
    """Output tokens spent reasoning: up to and including the end tag; all of them when the
    block never closed."""
    if end_id is not None and end_id in token_ids:
        return token_ids.index(end_id) + 1
    opened = inside or (bool(token_ids) and start_id is not None and token_ids[0] == start_id)
    return len(token_ids) if opened else 0
