"""Constrained decoding: what a request constrains its output to (`StructuredOutputs`), the
ingress check (`check_structured`), and the engine's grammar machinery (compile cache, per
sequence matchers, token bitmasks) built on llguidance (see `backend`); and the thinking budget
(`ThinkingBudget`), which forces the end-of-reasoning marker through the same token masks."""

from workers.structured.check import (
    GRAMMAR_ERROR,
    MAX_CHOICES,
    MAX_SCHEMA_BYTES,
    check_structured,
)
from workers.structured.spec import StructuredOutputs
from workers.structured.thinking import ThinkingBudget

__all__ = [
    "GRAMMAR_ERROR",
    "MAX_CHOICES",
    "MAX_SCHEMA_BYTES",
    "StructuredOutputs",
    "ThinkingBudget",
    "check_structured",
]
