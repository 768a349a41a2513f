"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one
of a few strings, or a Lark/EBNF grammar (vLLM's ``structured_outputs`` fields, and
OpenAI's ``response_format``), as one llguidance grammar.

:meth:`StructuredOutputs.grammar` is the single way to turn a constraint into the
grammar the engine enforces; tool calling builds its constraints the same way
(``StructuredOutputs(json=schema)`` for one function's arguments,
``StructuredOutputs(grammar=lark)`` for anything richer).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from xinfer.grammar.closed_objects import closed_objects

# JSON is written as json.dumps writes it (", " and ": "), with no other whitespace: a
# model cannot pad an answer with blanks forever, and the grammar ends with the document.
JSON_OPTIONS: dict[str, Any] = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of:

    - ``json``: a JSON schema (a dict, or its JSON text); ``strict=False`` lets the
      schema use keywords the grammar engine does not implement (they are ignored);
    - ``json_object``: any JSON object;
    - ``regex``: the whole output matches this regular expression (Rust ``regex`` syntax);
    - ``choice``: the output is one of these strings;
    - ``grammar``: a Lark grammar (llguidance's dialect) or a GBNF/EBNF one (``root ::= ...``).

    ``after_token_id``: the constraint applies to what follows this token (the end of a
    reasoning block, ``</think>``); before it the output is free. Invalid constraints
    raise ValueError with a one-line message."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    strict: bool = True
    after_token_id: int | None = field(default=None, compare=False)
    # vLLM's StructuredOutputsParams options, taken and changing nothing: JSON is written without whitespace and
    # objects closed already, and there is one grammar engine, none to fall back to
    disable_any_whitespace: bool = field(default=False, compare=False)
    whitespace_pattern: str | None = field(default=None, compare=False)
    disable_additional_properties: bool = field(default=False, compare=False)
    disable_fallback: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice)
        ):
            raise ValueError("structured outputs: choice must be a non-empty list of strings")
        import llguidance  # imported where a constraint is made: the rest of xinfer runs without it

        problem = llguidance.LLMatcher.validate_grammar(self.lark_or_llguidance)
        if problem:
            raise ValueError(f"invalid {self.kind}: {one_line(problem)}")
        if (self.regex is not None or self.grammar is not None) and not _admits_text(self.lark_or_llguidance):
            raise ValueError(f"invalid {self.kind}: it matches no text")

    @classmethod
    def of(cls, fields: dict[str, Any]) -> StructuredOutputs:
        """From a dict of its fields, as vLLM's ``StructuredOutputsParams`` takes them; another key is a ValueError
        naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise ValueError(f"structured outputs have no field {unknown[0]!r} (they have {', '.join(sorted(known))})")
        return cls(**fields)

    @property
    def kind(self) -> str:
        kind = next(kind for kind in KINDS if getattr(self, kind) not in (None, False))
        return {"json": "JSON schema", "json_object": "JSON object", "grammar": "grammar"}.get(kind, kind)

    @cached_property
    def lark_or_llguidance(self) -> str:
        """The llguidance grammar (its JSON form) of the constraint."""
        import llguidance

        grammar_of = llguidance.LLMatcher
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise ValueError(f"invalid JSON schema: not JSON ({error})") from None
            if not isinstance(schema, dict):
                raise ValueError(f"invalid JSON schema: must be an object, got {type(schema).__name__}")
            if self.strict and (bound := _inexact_bound(schema)) is not None:
                raise ValueError(f"invalid JSON schema: the bound {bound} is beyond 2**53, which the grammar engine "
                                 "cannot hold exactly (strict: false ignores it)")  # fmt: skip
            options: Any = {**JSON_OPTIONS, "lenient": not self.strict}
            return grammar_of.grammar_from_json_schema(closed_objects(schema), overrides=options)
        if self.regex is not None:
            return grammar_of.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_of.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert self.grammar is not None
        try:
            return llguidance.grammar_from("grammar", self.grammar)  # Lark as it is, GBNF converted
        except ValueError as error:
            raise ValueError(f"invalid grammar: {one_line(str(error))}") from None


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _inexact_bound(schema: Any) -> int | None:
    """A numeric bound of ``schema`` (or of a subschema) that a float64 does not hold exactly, if any."""
    if isinstance(schema, list):
        return next((b for item in schema if (b := _inexact_bound(item)) is not None), None)
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in BOUNDS and isinstance(value, int) and abs(value) > 2**53:
            return value
        if isinstance(value, (dict, list)) and (bound := _inexact_bound(value)) is not None:
            return bound
    return None


@functools.cache
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer("byte")


def _admits_text(grammar: str) -> bool:
    """Whether ``grammar`` matches some text: over a vocabulary of single bytes, its matcher's first mask leaves it
    in no error (a regex like ``[^\\s\\S]`` leaves nothing to start with)."""
    import llguidance

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    matcher.compute_logit_bias()
    return not matcher.is_error()


def one_line(problem: str) -> str:
    """llguidance's message without its source excerpts (``  1 | start: ...``, ``   ^``)."""
    lines = [line.strip() for line in problem.splitlines()]
    kept = [line for line in lines if line and not line.startswith(("^", "|")) and "|" not in line[:6]]
    return ": ".join(kept) or problem.strip()
