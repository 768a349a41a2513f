"""Constraints and their errors, without a model; the bitmask op against a per-token loop."""

from __future__ import annotations

import llguidance
import pytest
import torch

from xinfer.grammar import StructuredOutputs
from xinfer.grammar.matcher import Constraint
from xinfer.torch_ops import TorchOps


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"regex": "[a-"}, r"^invalid regex: .*unclosed character class$"),
        ({"grammar": "start: foo"}, r'^invalid grammar: .*unknown name: "foo"$'),
        ({"grammar": "root ::= [a-"}, r"^invalid grammar: "),
        ({"json": {"type": "objectx"}}, r"^invalid JSON schema: .*objectx"),
        ({"json": "{not json"}, r"^invalid JSON schema: not JSON"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, r"^invalid JSON schema: .*nowhere"),
        ({"json": {"type": "string", "format": "no-such-format"}}, r"^invalid JSON schema: .*no-such-format"),
        ({"choice": []}, r"choice must be a non-empty list of strings"),
        ({"choice": "yes"}, r"choice must be a non-empty list of strings"),  # (not the letters y, e, s)
        ({"json": {"type": "integer", "maximum": 2**53 + 3}}, r"the bound 9007199254740995 is beyond 2\*\*53"),
        ({"regex": "[^\\s\\S]"}, r"^invalid regex: it matches no text$"),
        ({}, r"exactly one of .* got none"),
        ({"regex": "a", "choice": ["b"]}, r"exactly one of .*\['regex', 'choice'\]"),
    ],
)
def test_invalid_constraints_raise_one_line_value_errors(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        StructuredOutputs(**fields)
    assert "\n" not in str(error.value)


BYTES = llguidance.LLTokenizer("byte")  # llguidance's tokenizer of one token per byte


def accepts(spec: StructuredOutputs, text: str) -> bool:
    """The constraint lets the output be exactly ``text``."""
    matcher = llguidance.LLMatcher(BYTES, spec.lark_or_llguidance, log_level=0)
    return matcher.consume_tokens(BYTES.tokenize_bytes(text.encode())) and matcher.is_accepting()


def test_lenient_schemas_ignore_unknown_keywords_when_not_strict():
    lenient = StructuredOutputs(json={"type": "string", "format": "no-such-format"}, strict=False)
    assert accepts(lenient, '"any text"')  # a JSON string, the unknown format ignored
    assert not accepts(lenient, "12") and not accepts(lenient, '"unclosed')


def test_gbnf_grammars_are_taken_too():
    yes_or_no = StructuredOutputs(grammar='root ::= "yes" | "no"')
    assert accepts(yes_or_no, "yes") and accepts(yes_or_no, "no")
    assert not accepts(yes_or_no, "maybe") and not accepts(yes_or_no, "ye")


def test_bitmask_op_masks_the_cleared_bits_of_the_listed_rows_only():
    generator = torch.Generator().manual_seed(0)
    vocab, words = 70, 3  # the bitmask covers 96 tokens: its tail past the vocabulary is ignored
    logits = torch.randn(4, vocab, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31, (2, words), generator=generator, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 1])
    out = logits.clone()
    TorchOps().apply_token_bitmask(out, bitmask, rows)
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for token in range(vocab):
            word = int(bitmask[i, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])


def test_tokens_past_a_narrow_bitmask_are_masked():
    logits = torch.zeros(1, 40)
    TorchOps().apply_token_bitmask(logits, torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([0]))
    assert torch.isfinite(logits[0, :32]).all() and torch.isinf(logits[0, 32:]).all()


class FakeMatcher:
    def __init__(self):
        self.consumed: list[int] = []

    def is_stopped(self) -> bool:
        return False

    def consume_token(self, token: int) -> bool:
        self.consumed.append(token)
        return True


def test_a_constraint_after_a_token_is_dormant_until_that_token():
    matcher = FakeMatcher()
    constraint = Constraint(matcher, words=1, after_token_id=9)  # type: ignore[arg-type]
    for token in (4, 5, 9):
        assert not constraint.wants_mask
        constraint.accept(token)
    assert constraint.wants_mask
    constraint.accept(6)
    assert matcher.consumed == [6]


def test_an_object_that_requires_more_than_its_properties_stays_open():
    """Closed to the listed properties (OpenAI's strict reading), it would admit no object at all."""
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]})
    assert accepts(spec, '{"a": "x", "b": 1}')
    assert not accepts(spec, '{"a": "x"}')


def test_a_dict_of_fields_takes_vllms_options_that_change_nothing_here_and_names_an_unknown_one():
    from xinfer import SamplingParams

    params = SamplingParams(
        structured_outputs={"choice": ["a"], "disable_any_whitespace": True, "disable_fallback": True}
    )
    assert params.structured_outputs == StructuredOutputs(choice=["a"])
    # and as keywords, as code written for vLLM's StructuredOutputsParams passes them (a TypeError before)
    assert StructuredOutputs(json_object=True, disable_any_whitespace=True, whitespace_pattern=r"[ ]?") == (
        StructuredOutputs(json_object=True)
    )
    with pytest.raises(ValueError, match=r"structured outputs have no field 'jsn' \(they have "):
        SamplingParams(structured_outputs={"jsn": {}})
