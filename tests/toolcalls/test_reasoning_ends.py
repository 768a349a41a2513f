"""Where a model's reasoning ends, whole and streamed, as vLLM's reasoning parsers read it."""

from __future__ import annotations

import pytest

from xinfer.text.reasoning import THINK, ReasoningStream, split
from xinfer.toolcalls import parser_for

QWEN35_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def streamed(text: str, inside: bool, size: int) -> tuple[str, str]:
    stream = ReasoningStream(THINK, inside)
    parts = [stream.push(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def test_an_end_tag_the_prompt_did_not_open_ends_reasoning():
    """vLLM's Qwen3ReasoningParser / DeepSeekR1ReasoningParser ``extract_reasoning``: with ``</think>`` in the
    output, the text before it is reasoning, and the tag is no content."""
    assert split("I should call the tool.\n</think>\n\nThe answer.", THINK) == (
        "I should call the tool.\n",
        "The answer.",
    )


def test_an_end_tag_after_a_closed_block_stays_answer_text():
    assert split("<think>a</think>b </think> c", THINK) == ("a", "b </think> c")


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_qwen_tool_call_before_the_end_tag_ends_reasoning(size):
    """vLLM's Qwen3ReasoningParser: ``<tool_call>`` that ``<function=`` follows (blanks between) is an implicit
    end of reasoning; the answer starts with the call, which the qwen3_coder parser reads."""
    text = "Need the weather.\n" + QWEN35_CALL
    assert split(text, THINK, inside=True) == ("Need the weather.\n", QWEN35_CALL)
    assert streamed(text, True, size) == ("Need the weather.\n", QWEN35_CALL)
    [call] = parser_for("qwen3_coder")().parse(QWEN35_CALL).tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_tool_call_tag_mentioned_in_reasoning_stays_reasoning(size):
    """Without ``<function`` after it, vLLM keeps a ``<tool_call>`` mention in the reasoning."""
    text = "I could use <tool_call> tags here.</think>Answer."
    assert split(text, THINK, inside=True) == ("I could use <tool_call> tags here.", "Answer.")
    assert streamed(text, True, size) == ("I could use <tool_call> tags here.", "Answer.")
