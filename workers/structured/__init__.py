"""Constrained decoding: what a request constrains its output to (`StructuredOutputs`), the
ingress check (`check_structured`), and the engine's grammar machinery (compile cache, per
sequence matchers, token bitmasks) built on llguidance (see `backend`)."""

from workers.structured.check import (
    GRAMMAR_ERROR,
    MAX_CHOICES,
    MAX_SCHEMA_BYTES,
    check_structured,
)
from workers.structured.spec import StructuredOutputs

__all__ = [
    "GRAMMAR_ERROR",
    "MAX_CHOICES",
    "MAX_SCHEMA_BYTES",
    "StructuredOutputs",
    "check_structured",
]
