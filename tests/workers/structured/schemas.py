"""A seeded generator of JSON schemas for the structured-output tests: objects, nested
objects, arrays with minItems/maxItems, enums, integers and numbers with bounds, strings with
length limits. Strings and arrays are kept short so a near-random model finishes them within
a test's max_tokens; validity can only come from the constraint."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["id", "name", "age", "tags", "score", "kind", "meta", "items", "ok", "level"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A schema whose root is an object (what response_format json_schema asks for)."""
    return _object(rng, depth)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 3))
    props = {n: _value(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": props,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "enum", "boolean", "array"]
    if depth < 3:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20)}
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 5)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        lo = rng.randint(0, 2)
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b"]}])
        if depth < 2 and rng.random() < 0.3:
            item = _object(rng, depth + 1)
        return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    return _object(rng, depth)
