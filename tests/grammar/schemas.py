"""Twenty JSON schemas whose every instance is short (bounded strings, integers with
bounds, few items, no floats), so that even a random model's constrained output ends
within a small max_tokens; each with a prompt for a real model."""

from __future__ import annotations

from typing import Any


def obj(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {**required, **optional},
        "required": list(required),
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 12}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj({"name": NAME, "age": SMALL})),
    ("a yes/no verdict", obj({"verdict": {"type": "boolean"}})),
    ("a colour", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("a city and its country", obj({"city": NAME, "country": NAME})),
    ("three tags", obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}})),
    ("a point", obj({"x": SMALL, "y": SMALL})),
    ("a status", obj({"status": {"const": "ok"}, "code": {"type": "integer", "minimum": 200, "maximum": 599}})),
    ("a book", obj({"title": NAME, "year": {"type": "integer", "minimum": 1000, "maximum": 2030}})),
    ("a nested address", obj({"address": obj({"street": NAME, "number": SMALL})})),
    ("a list of numbers", obj({"values": {"type": "array", "items": SMALL, "maxItems": 4}})),
    ("a nullable nickname", obj({"nickname": {"anyOf": [NAME, {"type": "null"}]}})),
    ("a pet", obj({"species": {"enum": ["cat", "dog"]}, "legs": {"enum": [2, 4]}})),
    ("a rating", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": NAME})),
    ("a date", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("a pair of flags", obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}})),
    ("a team", obj({"members": {"type": "array", "items": obj({"name": NAME}), "minItems": 1, "maxItems": 2}})),
    ("a language", obj({"language": {"enum": ["en", "fr", "de"]}, "native": {"type": "boolean"}})),
    ("a short word", {"type": "string", "maxLength": 8}),
    ("an answer", {"enum": ["A", "B", "C", "D"]}),
    ("a count", {"type": "integer", "minimum": 0, "maximum": 1000}),
]
