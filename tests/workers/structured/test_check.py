"""check_structured: the ingress check of a StructuredOutputs spec, and SamplingParams' field."""

from __future__ import annotations

import pytest

from workers import SamplingParams
from workers.structured import MAX_CHOICES, MAX_SCHEMA_BYTES, StructuredOutputs, check_structured


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs.from_schema(
            {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 9},
                    "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                    "c": {"type": "string", "minLength": 1, "maxLength": 4},
                },
                "required": ["a"],
            }
        ),
        StructuredOutputs.from_schema(True),
        StructuredOutputs(json_object=True),
        StructuredOutputs(regex=r"\d{3}-[a-z]+"),
        StructuredOutputs(choice=("yes", "no", 'say "hi"')),
        StructuredOutputs(grammar='start: "a" b\nb: "b"+'),  # Lark
        StructuredOutputs(grammar='root ::= "a" | "b"'),  # GBNF / EBNF
        StructuredOutputs(regex=r"[a-z]+", after=(151668,)),  # after a reasoning marker
    ],
)
def test_valid_specs_pass(spec: StructuredOutputs) -> None:
    check_structured(spec, None)


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (StructuredOutputs(json="{not json"), r"^structured_outputs\.json is not valid JSON"),
        (StructuredOutputs(json="[1, 2]"), r"^structured_outputs\.json must be a JSON schema"),
        (
            StructuredOutputs.from_schema({"type": "frobnicate"}),
            r"^structured_outputs\.json is not a supported JSON schema: .*frobnicate",
        ),
        # Features the backend does not implement are named, not ignored.
        (
            StructuredOutputs.from_schema({"type": "array", "uniqueItems": True}),
            r"^structured_outputs\.json .*uniqueItems",
        ),
        (
            StructuredOutputs.from_schema({"not": {"type": "string"}}),
            r"^structured_outputs\.json .*\"not\"",
        ),
        (
            StructuredOutputs.from_schema({"type": "integer", "minimum": 5, "maximum": 2}),
            r"^structured_outputs\.json .*minimum",
        ),
        (
            StructuredOutputs.from_schema({"$ref": "#/definitions/missing"}),
            r"^structured_outputs\.json .*missing",
        ),
        (StructuredOutputs(regex="a[b"), r"^structured_outputs\.regex is not a valid regex"),
        (StructuredOutputs(regex="a(?=b)"), r"(?s)^structured_outputs\.regex .*look-around"),
        (
            StructuredOutputs(grammar="start: undefined_rule"),
            r"(?s)^structured_outputs\.grammar is not a valid grammar: .*undefined_rule",
        ),
        (
            StructuredOutputs(json='{"description": "' + "x" * MAX_SCHEMA_BYTES + '"}'),
            rf"^structured_outputs\.json is \d+ bytes; at most {MAX_SCHEMA_BYTES}",
        ),
        (
            StructuredOutputs(choice=tuple(str(i) for i in range(MAX_CHOICES + 1))),
            rf"^structured_outputs\.choice has {MAX_CHOICES + 1} entries",
        ),
    ],
)
def test_bad_specs_raise_naming_the_field(spec: StructuredOutputs, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        check_structured(spec, None)


def test_verdicts_are_cached_per_spec() -> None:
    from workers.structured.check import _verdict

    spec = StructuredOutputs(regex=r"[0-9]{2,7}cached")
    before = _verdict.cache_info()
    check_structured(spec)
    check_structured(StructuredOutputs(regex=r"[0-9]{2,7}cached"))  # equal spec: a hit
    after = _verdict.cache_info()
    assert after.hits - before.hits >= 1
    assert after.currsize <= after.maxsize
    check_structured(spec.starting_after([5, 6]))  # `after` aside, the same grammar: a hit
    assert _verdict.cache_info().hits - after.hits >= 1


def test_not_a_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="^structured_outputs must be a StructuredOutputs"):
        check_structured({"regex": "a"}, None)  # type: ignore[arg-type]


def test_sampling_params_field_is_typed() -> None:
    spec = StructuredOutputs(regex="a+")
    assert SamplingParams(structured_outputs=spec).structured_outputs is spec
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match="^structured_outputs must be a StructuredOutputs"):
        SamplingParams(structured_outputs={"regex": "a+"})  # type: ignore[arg-type]
