"""What a request constrains its output to (`StructuredOutputs`): the one type that the
ingresses build from OpenAI / vLLM / gRPC fields and the engine compiles into a grammar.

Exactly one constraint is set. The value is kept as the user's text (a JSON schema as
compact JSON, a regex, a grammar) so the spec is hashable and is the key of the engine's
compile cache. Checking that a schema, regex or grammar compiles is the grammar backend's job
(`workers.structured`), done at the edge before a request is routed.

`after` makes the constraint start late: a reasoning model's `<think> ... </think>` is free
text, and the grammar applies from the token after the output first ends with the
end-of-reasoning marker's ids (the ingress sets it with `starting_after` when a reasoning
parser is on). It is not part of the grammar: the compile cache keys on `grammar_key`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from workers.structured.thinking import is_token_id


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One output constraint; build it with one of the keyword fields set (vLLM's names).

    As vLLM does, `json` takes the schema as an object (a dict, or true) or as its JSON
    text, and `choice` a list: they are kept as JSON text and a tuple, so the spec hashes."""

    json: str | None = None  # a JSON schema, as canonical JSON text (see `from_schema`)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # a grammar in the backend's syntax (Lark / EBNF)
    # The grammar starts after the output ends with these token ids (the end-of-reasoning
    # marker: one special token such as Qwen3's `</think>`, or several ids); None: at once.
    after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (an object, or its JSON "
                    f"text), got {type(self.json).__name__}"
                )
            object.__setattr__(self, "json", _schema_text(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [name for name in _KINDS if _is_set(getattr(self, name))]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(_KINDS)}; got {set_fields or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )
        if isinstance(self.after, list):
            object.__setattr__(self, "after", tuple(self.after))
        if self.after is not None and (
            not isinstance(self.after, tuple)
            or not self.after
            or not all(is_token_id(t) for t in self.after)
        ):
            raise ValueError(
                "structured_outputs.after must be a non-empty list of token ids "
                f"(non-negative ints), got {self.after!r}"
            )

    @property
    def kind(self) -> str:
        """The name of the one field that is set: "json", "json_object", "regex", ..."""
        return next(name for name in _KINDS if _is_set(getattr(self, name)))

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | bool) -> StructuredOutputs:
        """A JSON-schema constraint; the same schema text gives equal (cache-sharing) specs.

        Keys keep the schema's order: the grammar emits an object's properties in that
        order, as OpenAI's structured outputs do, so they are not sorted here."""
        return cls(json=_schema_text(schema))

    def starting_after(self, token_ids: Iterable[int]) -> StructuredOutputs:
        """A copy whose grammar starts after the output ends with `token_ids` (validated)."""
        return dataclasses.replace(self, after=tuple(token_ids))

    @property
    def grammar_key(self) -> StructuredOutputs:
        """The spec without `after`: what the grammar depends on, so specs differing only in
        where the grammar starts share one compile (and one check verdict)."""
        return self if self.after is None else dataclasses.replace(self, after=None)


def _schema_text(schema: dict[str, Any] | bool) -> str:
    return json.dumps(schema, separators=(",", ":"))


_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _is_set(value: object) -> bool:
    return value is not None and value is not False
