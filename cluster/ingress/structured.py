"""Request fields -> the engine's output constraint (`StructuredOutputs`), for both ingresses.

OpenAI clients send `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}); vLLM clients send `structured_outputs`
({"json" | "regex" | "choice" | "grammar": ...}) or the older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`. A request may set one of them; two are
a 400 naming both, since which one wins would be a guess. The result carries the field the
client wrote (`Constraint.field`), so that `check` — which asks the grammar backend whether
the constraint compiles, before the request is routed — names that field in its 400.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.errors import InvalidRequestError
from workers.structured import MAX_SCHEMA_BYTES, StructuredOutputs

# vLLM's `structured_outputs` keys (and the guided_* alias of each).
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar")
GUIDED_FIELDS = {f"guided_{k}": k for k in STRUCTURED_KEYS}
# A schema this large (characters) is compiled on a worker thread rather than inline.
OFF_LOOP_SCHEMA_CHARS = 4096


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint and the request field it came from."""

    spec: StructuredOutputs
    field: str  # e.g. "response_format.json_schema.schema", "structured_outputs.regex"


def from_openai(
    response_format: Mapping[str, Any] | None = None,
    structured_outputs: Mapping[str, Any] | None = None,
    guided: Mapping[str, Any] | None = None,
) -> Constraint | None:
    """The constraint of an OpenAI-style request, or None; `guided` maps guided_* field names
    to their values (None = unset)."""
    found: list[Constraint] = []
    if response_format is not None:
        c = _response_format(response_format)
        if c is not None:
            found.append(c)
    if structured_outputs is not None:
        found.append(_structured_outputs(structured_outputs))
    for name, value in (guided or {}).items():
        if value is not None:
            found.append(value_constraint(name, GUIDED_FIELDS[name], value))
    return only_one(found)


def only_one(found: list[Constraint]) -> Constraint | None:
    """The one constraint of a request; several -> 400 naming them all."""
    if len(found) > 1:
        names = ", ".join(c.field for c in found)
        raise InvalidRequestError(
            found[1].field, f"set at most one output constraint; this request sets {names}"
        )
    return found[0] if found else None


def schema_constraint(schema: Any, field: str) -> Constraint:
    """A JSON-schema constraint from a parsed schema (an object, or true)."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(
            field, f"{field} must be a JSON schema object, got {type(schema).__name__}"
        )
    spec = StructuredOutputs.from_schema(schema)
    size = len(spec.json or "")
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            field, f"{field} is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} are allowed"
        )
    return Constraint(spec, field)


def grammar_constraint(grammar: str, field: str) -> Constraint:
    """A grammar constraint kvray built itself (e.g. forced tool calls in the model's own
    format), held to the size bound of the schemas it embeds."""
    if len(grammar) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            field, f"{field} makes a grammar of {len(grammar)} bytes; at most {MAX_SCHEMA_BYTES}"
        )
    return Constraint(StructuredOutputs(grammar=grammar), field)


def schema_text_constraint(text: str, field: str) -> Constraint:
    """A JSON-schema constraint from schema text (gRPC sends the schema as a string)."""
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            field, f"{field} is {len(text)} characters; at most {MAX_SCHEMA_BYTES} are allowed"
        )
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidRequestError(field, f"{field} is not valid JSON: {err}") from None
    return schema_constraint(schema, field)


async def check(constraint: Constraint | None, tokenizer: Any = None) -> None:
    """Whether the grammar backend can serve the constraint; 400 naming its field if not.
    Large schemas compile on a worker thread, so the ingress's event loop keeps serving."""
    if constraint is None:
        return
    from workers.structured import check_structured

    spec = constraint.spec
    size = len(spec.json or spec.regex or spec.grammar or "")
    try:
        if size >= OFF_LOOP_SCHEMA_CHARS:
            await asyncio.to_thread(check_structured, spec, tokenizer)
        else:
            check_structured(spec, tokenizer)
    except ValueError as err:
        raise InvalidRequestError(constraint.field, _reword(str(err), constraint)) from None


def _reword(message: str, constraint: Constraint) -> str:
    """The backend's message names its own field ("structured_outputs.json ..."): name the
    request's instead."""
    own = f"structured_outputs.{constraint.spec.kind}"
    if message.startswith(own):
        return constraint.field + message[len(own) :]
    return f"{constraint.field}: {message}"


def _response_format(rf: Mapping[str, Any]) -> Constraint | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(StructuredOutputs(json_object=True), "response_format")
    if kind != "json_schema":
        raise InvalidRequestError(
            "response_format.type",
            f"response_format.type must be one of text, json_object, json_schema; got {kind!r}",
        )
    js = rf.get("json_schema")
    if not isinstance(js, Mapping):
        raise InvalidRequestError(
            "response_format.json_schema",
            "response_format.json_schema must be an object with name and schema",
        )
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError(
            "response_format.json_schema.name", "response_format.json_schema.name must be a string"
        )
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(
            "response_format.json_schema.strict",
            "response_format.json_schema.strict must be a boolean",
        )
    field = "response_format.json_schema.schema"
    if "schema" not in js:
        raise InvalidRequestError(field, f"{field} is required")
    # The output always follows the schema: `strict` only says the client wants that.
    return schema_constraint(js["schema"], field)


def _structured_outputs(so: Mapping[str, Any]) -> Constraint:
    keys = [k for k in STRUCTURED_KEYS if so.get(k) is not None]
    unknown = sorted(set(so) - {*STRUCTURED_KEYS, "json_object"})
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs.{unknown[0]}",
            f"structured_outputs.{unknown[0]} is not supported; "
            f"use one of {', '.join(STRUCTURED_KEYS)}",
        )
    if so.get("json_object"):
        keys.append("json_object")
    if len(keys) != 1:
        raise InvalidRequestError(
            "structured_outputs",
            f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KEYS)}; "
            f"got {keys or 'none'}",
        )
    key = keys[0]
    if key == "json_object":
        return Constraint(StructuredOutputs(json_object=True), "structured_outputs.json_object")
    return value_constraint(f"structured_outputs.{key}", key, so[key])


def value_constraint(field: str, kind: str, value: Any) -> Constraint:
    """One constraint of `kind` (json, regex, choice, grammar) from a request value."""
    if kind == "json":
        # vLLM accepts the schema as an object or as its JSON text.
        if isinstance(value, str):
            return schema_text_constraint(value, field)
        return schema_constraint(value, field)
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise InvalidRequestError(field, f"{field} must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(field, f"{field} must hold non-empty strings only")
        if sum(len(c) for c in value) > MAX_SCHEMA_BYTES:
            raise InvalidRequestError(
                field, f"{field} is over {MAX_SCHEMA_BYTES} characters in total"
            )
        return Constraint(StructuredOutputs(choice=tuple(value)), field)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(field, f"{field} must be a non-empty string")
    if len(value) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            field, f"{field} is {len(value)} characters; at most {MAX_SCHEMA_BYTES} are allowed"
        )
    spec = StructuredOutputs(regex=value) if kind == "regex" else StructuredOutputs(grammar=value)
    return Constraint(spec, field)
