"""`check_structured`: is a `StructuredOutputs` spec usable? Called at the ingress for every
constrained request, before it is routed, so it needs no engine and is cached.

A bad spec raises ValueError whose message starts with "structured_outputs.<kind>" (the
field the ingress blames): text over the size bound, a schema that is not JSON, schema
keywords the backend does not implement (named, never silently ignored), an unsatisfiable
schema, a regex or grammar that does not parse.
"""

from __future__ import annotations

import functools
from typing import Any

from workers.structured.backend import grammar_error, grammar_text
from workers.structured.spec import StructuredOutputs

# Bounds on what one request may ask the grammar compiler to build. 64 KiB of schema is far
# beyond any hand-written tool schema; larger ones are more likely abuse than use.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_CHOICES = 1024
# Distinct specs whose verdict is remembered (the verdict does not depend on the tokenizer).
CHECK_CACHE_SIZE = 1024
# The stop_reason of a request the engine ended because its grammar could not be used
# (finish_reason "abort"): a compile error the check did not foresee, or grammar_timeout_s.
GRAMMAR_ERROR = "structured_outputs_error"


def spec_bytes(spec: StructuredOutputs) -> int:
    """The size of the user's constraint text, what MAX_SCHEMA_BYTES bounds."""
    if spec.choice is not None:
        return sum(len(c.encode()) for c in spec.choice)
    text = spec.json or spec.regex or spec.grammar or ""
    return len(text.encode())


def check_structured(spec: StructuredOutputs, tokenizer: Any = None) -> None:
    """Raises ValueError ("structured_outputs.<kind> ...") when `spec` cannot be served.

    `tokenizer` (a workers.tokenizer.Tokenizer) is accepted for the interface's sake: the
    checks made here do not depend on the vocabulary, which is what lets one verdict per spec
    be cached and the check run without an engine.
    """
    if not isinstance(spec, StructuredOutputs):
        raise ValueError(
            f"structured_outputs must be a StructuredOutputs, got {type(spec).__name__}"
        )
    error = _verdict(spec.grammar_key)  # `after` changes where the grammar starts, not it
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=CHECK_CACHE_SIZE)
def _verdict(spec: StructuredOutputs) -> str | None:
    """The error message for `spec`, or None: a pure function of the (frozen) spec."""
    field = f"structured_outputs.{spec.kind}"
    size = spec_bytes(spec)
    if size > MAX_SCHEMA_BYTES:
        return f"{field} is {size} bytes; at most {MAX_SCHEMA_BYTES} are allowed"
    if spec.choice is not None and len(spec.choice) > MAX_CHOICES:
        return f"{field} has {len(spec.choice)} entries; at most {MAX_CHOICES} are allowed"
    try:
        grammar = grammar_text(spec)
    except ValueError as e:
        return str(e) if str(e).startswith(field) else f"{field}: {e}"
    error = grammar_error(grammar)
    if error is None:
        return None
    what = {
        "json": "is not a supported JSON schema",
        "json_object": "cannot be compiled",
        "regex": "is not a valid regex",
        "choice": "cannot be compiled",
        "grammar": "is not a valid grammar",
    }[spec.kind]
    return f"{field} {what}: {error}"
