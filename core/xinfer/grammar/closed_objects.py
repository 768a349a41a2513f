"""JSON schemas' objects closed to the properties they list, as OpenAI's strict schemas and vLLM's grammars read
them (JSON Schema itself leaves them open)."""

from __future__ import annotations

from typing import Any

# a schema's keywords whose value is a subschema, or subschemas by name
SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "unevaluatedItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# beside these, an object's properties may come from elsewhere (another branch, a reference): it is left open
OPEN_ENDED = ("additionalProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref", "if",
              "dependentSchemas")  # fmt: skip


def closed_objects(schema: Any, close: bool = True) -> Any:
    """A JSON schema whose objects hold only the properties they list unless they say otherwise:
    ``additionalProperties: false`` where an object lists its properties and says nothing of others, as OpenAI's
    strict schemas have it and vLLM's grammars read a schema. Left open, a grammar lets the model add keys until
    its tokens run out (an answer cut mid-JSON), or write a key twice. ``close``: this object itself may be closed
    (not a branch that adds to its parent's properties)."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in SUBSCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    for key in ("items", "prefixItems"):
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(item) for item in closed[key]]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(closed.get(key), list):
            # allOf's branches, or branches beside the object's own properties, add to other properties: left open
            alone = key != "allOf" and "properties" not in closed
            closed[key] = [closed_objects(item, close=alone) for item in closed[key]]
    for key in SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(item) for name, item in closed[key].items()}
    properties = closed.get("properties")
    if close and isinstance(properties, dict) and not any(key in closed for key in OPEN_ENDED) and _fits(closed):
        closed["additionalProperties"] = False
    return closed


def _fits(schema: dict[str, Any]) -> bool:
    """Whether an object of ``schema``'s listed properties alone can satisfy it: it requires none besides them."""
    required = schema.get("required", [])
    return not isinstance(required, list) or all(name in schema["properties"] for name in required)
