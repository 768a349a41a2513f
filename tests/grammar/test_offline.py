"""Structured outputs through ``LLM.generate`` on the embedded SmolLM2: constrained rows
follow their grammar (checked by ``jsonschema`` and ``re``, not by us), rows without
one draw exactly the tokens they draw in a batch without any grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from xinfer import LLM, SamplingParams
from xinfer.grammar import StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "student"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def chat(llm: LLM, question: str) -> dict:
    text = llm.tokenizer.chat_template.render([{"role": "user", "content": question}], add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}


def test_mixed_batch_constrains_its_rows_and_leaves_the_others_alone(llm):
    person = chat(llm, "Describe a student named Ana, aged 21, as JSON.")
    free = chat(llm, "Write one sentence about the sea.")
    date = chat(llm, "When did the first moon landing happen? Give the date.")
    unconstrained = [
        (free, SamplingParams(temperature=0, max_tokens=12)),
        (free, SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12)),
    ]
    constrained = [
        (person, SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(json=PERSON))),
        (
            date,
            SamplingParams(temperature=0.8, seed=3, max_tokens=16, structured_outputs=StructuredOutputs(regex=DATE)),
        ),
        (person, SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no", "maybe"]})),
        (date, SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputs(grammar=LARK))),
    ]
    rows = unconstrained[:1] + constrained[:2] + unconstrained[1:] + constrained[2:]
    mixed = llm.generate([prompt for prompt, _ in rows], [params for _, params in rows])
    alone = llm.generate([prompt for prompt, _ in unconstrained], [params for _, params in unconstrained])

    free_rows = [mixed[0], mixed[3]]
    assert [o.outputs[0].token_ids for o in free_rows] == [o.outputs[0].token_ids for o in alone]
    answer = json.loads(mixed[1].outputs[0].text)
    jsonschema.validate(answer, PERSON)
    assert re.fullmatch(DATE, mixed[2].outputs[0].text)
    assert mixed[4].outputs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", mixed[5].outputs[0].text)
    # a grammar that cannot continue ends its row: none ran into max_tokens
    assert all(o.outputs[0].finish_reason == "stop" for o in (mixed[1], mixed[2], mixed[4], mixed[5]))


def test_each_of_n_choices_follows_the_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, structured_outputs={"json_object": True})
    (out,) = llm.generate([chat(llm, "Give me a JSON object about a cat.")], params)
    for choice in out.outputs:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:  # cut by max_tokens: still a prefix the grammar allowed
            assert choice.text.startswith("{")


def test_penalties_and_a_grammar_together(llm):
    params = SamplingParams(
        temperature=0, max_tokens=30, repetition_penalty=1.3, structured_outputs=StructuredOutputs(regex=r"(ab|cd){3}")
    )
    (out,) = llm.generate([chat(llm, "Say something.")], params)
    assert re.fullmatch(r"(ab|cd){3}", out.outputs[0].text)


def test_a_bad_constraint_is_a_one_line_value_error(llm):
    with pytest.raises(ValueError, match=r"^invalid regex: .*unclosed character class$"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"regex": "[a-"}))
    assert llm.generate(["hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving


def test_a_constraint_the_other_filters_leave_no_token_ends_with_an_error(llm):
    """A choice whose only word bad_words bans: every token masked, the one drawn is none the grammar allows; the
    request ends with finish reason "error", not a "stop" whose text breaks the constraint."""
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"choice": ["yes"]}, bad_words=["yes"])
    (out,) = llm.generate([chat(llm, "Yes or no?")], params)
    assert out.outputs[0].finish_reason == "error"
    assert llm.generate(["hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving


@pytest.mark.parametrize("where", ["accept", "fill_bitmask"])
def test_a_grammar_that_fails_ends_its_request_alone(llm, monkeypatch, where):
    """A matcher that raises (following a token, read back while the forward runs, or computing its mask before
    the draw) ends its request with finish reason "error"; the other rows of the batch, constrained or not, get
    the tokens they get without the fault."""
    from xinfer.grammar import matcher

    date = chat(llm, "When did the first moon landing happen? Give the date.")
    requests = [
        (chat(llm, "Write one sentence about the sea."), SamplingParams(temperature=0, max_tokens=12)),
        (date, SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputs(regex=DATE))),
        (date, SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]})),
    ]
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    faulty = []  # the date request's constraint, once built
    compile_constraint = llm.engine.grammars().compile

    def compiling(spec):
        constraint = compile_constraint(spec)
        if spec.regex == DATE:
            faulty.append(constraint)
        return constraint

    monkeypatch.setattr(llm.engine.grammars(), "compile", compiling)
    if where == "accept":
        accept, followed = matcher.Constraint.accept, []

        def accepting(self, token):
            if self in faulty:
                followed.append(token)
                if len(followed) == 3:
                    raise RuntimeError("the matcher broke")
            accept(self, token)

        monkeypatch.setattr(matcher.Constraint, "accept", accepting)
    else:
        fill = matcher.fill_bitmask

        def filling(constraints):
            if any(c in faulty for c in constraints):
                raise RuntimeError("the matcher broke")
            return fill(constraints)

        monkeypatch.setattr(matcher, "fill_bitmask", filling)
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert got[1].finish_reason == "error" and got[1].error == "RuntimeError: the matcher broke"
    assert [got[0].token_ids, got[2].token_ids] == [expected[0], expected[2]]
    assert all(pool.num_free_blocks == pool.num_blocks for pool in llm.engine.cache.pools)
