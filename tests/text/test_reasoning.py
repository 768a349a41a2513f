"""Reasoning split from answers, on outputs written as each family's models write them
(the tags and layout of Qwen3, DeepSeek R1, GLM-4.5 and MiniMax-M2 answers), whole and
streamed in two deltas cut at every position."""

from __future__ import annotations

import pytest

from xinfer.text.reasoning import THINK, ReasoningStream, opens_reasoning, reasoning_token_count, split

# (prompt tail the template renders, output, expected reasoning, expected answer)
RECORDED = {
    "qwen3 thinking": (
        "<|im_start|>assistant\n",
        "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\n2 + 2 = 4.",
        "\nThe user asks for 2+2. That is 4.\n",
        "2 + 2 = 4.",
    ),
    "qwen3 enable_thinking=false": (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "Paris is the capital of France.",
        None,
        "Paris is the capital of France.",
    ),
    "deepseek r1 (the template opens the block)": (
        "<\uff5cAssistant\uff5c><think>\n",  # DeepSeek writes fullwidth bars
        "Okay, so 3 < 5 and 5 > 3, </thin k> is not a tag.\n</think>\n\nYes: 3 < 5.",
        "Okay, so 3 < 5 and 5 > 3, </thin k> is not a tag.\n",
        "Yes: 3 < 5.",
    ),
    "glm-4.5": (
        "<|assistant|>",
        "<think>Let me count the letters in <b>strawberry</b>: three r.</think>\nThere are 3 r's.",
        "Let me count the letters in <b>strawberry</b>: three r.",
        "There are 3 r's.",
    ),
    "minimax-m2, cut by max_tokens inside the block": (
        "]~b]ai\n",
        "<think>\nI should check the units first, then",
        "\nI should check the units first, then",
        "",
    ),
    "no reasoning at all": ("<|im_start|>assistant\n", "  <b>bold</b> answer", None, "  <b>bold</b> answer"),
    "an answer that merely starts like the tag": ("<|im_start|>assistant\n", "<thin ice>", None, "<thin ice>"),
}


@pytest.mark.parametrize("case", RECORDED)
def test_whole_outputs_split(case):
    prompt, output, reasoning, answer = RECORDED[case]
    assert split(output, THINK, opens_reasoning(prompt, THINK)) == (reasoning, answer)


@pytest.mark.parametrize("case", RECORDED)
def test_streamed_outputs_split_the_same_at_every_cut(case):
    prompt, output, reasoning, answer = RECORDED[case]
    for cut in range(len(output) + 1):
        for pieces in ([output[:cut], output[cut:]], list(output) if cut == 0 else []):
            if not pieces:
                continue
            stream = ReasoningStream(THINK, opens_reasoning(prompt, THINK))
            got_reasoning, got_answer = "", ""
            for piece in pieces:
                r, a = stream.push(piece)
                got_reasoning, got_answer = got_reasoning + r, got_answer + a
            r, a = stream.finish()
            assert (got_reasoning + r, got_answer + a) == (reasoning or "", answer), (cut, pieces)


def test_reasoning_tokens_count_up_to_the_end_tag():
    start, end = 7, 8
    assert reasoning_token_count([7, 1, 2, 8, 3, 4], start, end, inside=False) == 4
    assert reasoning_token_count([1, 2, 8, 3], start, end, inside=True) == 3
    assert reasoning_token_count([7, 1, 2], start, end, inside=False) == 3  # cut inside the block
    assert reasoning_token_count([1, 2, 3], start, end, inside=False) == 0
    assert reasoning_token_count([1, 2, 3], start, end, inside=True) == 3
