"""Request fields -> one output constraint (cluster/ingress/structured.py): OpenAI's
response_format, vLLM's structured_outputs and guided_* names, conflicts, bounds, and the
backend check before routing, each error naming the field the client wrote."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.errors import InvalidRequestError
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.ingress import structured
from workers.structured import MAX_SCHEMA_BYTES, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
USER = [{"role": "user", "content": "hi"}]


def _spec(**fields: object) -> StructuredOutputs | None:
    c = ChatCompletionRequest(messages=USER, **fields).constraint()
    return None if c is None else c.spec


def _error(**fields: object) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        ChatCompletionRequest(messages=USER, **fields).sampling_params()
    return err.value


def test_response_format_json_schema_and_json_object() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert _spec(response_format=rf) == StructuredOutputs.from_schema(SCHEMA)
    assert _spec(response_format={"type": "json_object"}) == StructuredOutputs(json_object=True)
    assert _spec(response_format={"type": "text"}) is None
    assert _spec() is None


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs.from_schema(SCHEMA)),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutputs.from_schema(SCHEMA),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputs(regex="[a-z]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputs(choice=("a", "b"))),
        (
            {"structured_outputs": {"grammar": 'start: "x"'}},
            StructuredOutputs(grammar='start: "x"'),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputs.from_schema(SCHEMA)),
        ({"guided_regex": "[0-9]+"}, StructuredOutputs(regex="[0-9]+")),
        ({"guided_choice": ["x", "y"]}, StructuredOutputs(choice=("x", "y"))),
        ({"guided_grammar": 'start: "x"'}, StructuredOutputs(grammar='start: "x"')),
    ],
)
def test_vllm_fields_and_aliases(fields: dict, want: StructuredOutputs) -> None:
    assert _spec(**fields) == want
    # The same fields on /v1/completions, into the engine's SamplingParams.
    params = CompletionRequest(prompt="x", **fields).sampling_params()
    assert params.structured_outputs == want


def test_two_constraints_are_a_400_naming_both() -> None:
    err = _error(response_format={"type": "json_object"}, guided_regex="a+")
    assert err.param == "guided_regex"
    assert "response_format" in err.message and "guided_regex" in err.message
    err = _error(structured_outputs={"regex": "a", "choice": ["b"]})
    assert err.param == "structured_outputs" and "regex" in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_regex": 5}, "guided_regex"),
    ],
)
def test_malformed_fields_name_the_field(fields: dict, param: str) -> None:
    err = _error(**fields)
    assert err.param == param and err.http_status == 400


def test_schema_size_is_bounded() -> None:
    big = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    err = _error(guided_json=big)
    assert err.param == "guided_json" and str(MAX_SCHEMA_BYTES) in err.message
    err = _error(structured_outputs={"regex": "a" * (MAX_SCHEMA_BYTES + 1)})
    assert err.param == "structured_outputs.regex"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"guided_grammar": "start: ("}, "guided_grammar", "grammar"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format.json_schema.schema",
            "strin",
        ),
    ],
)
def test_the_backend_check_names_the_request_field(fields: dict, param: str, words: str) -> None:
    constraint = ChatCompletionRequest(messages=USER, **fields).constraint()
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(structured.check(constraint))
    assert err.value.param == param
    assert err.value.message.startswith(param) and words in err.value.message


def test_a_good_constraint_passes_the_check() -> None:
    for fields in ({"guided_json": SCHEMA}, {"guided_choice": ["a"]}, {"guided_regex": "a+"}):
        asyncio.run(structured.check(ChatCompletionRequest(messages=USER, **fields).constraint()))
    asyncio.run(structured.check(None))


def test_schema_text_for_grpc() -> None:
    c = structured.schema_text_constraint(json.dumps(SCHEMA), "sampling.json_schema")
    assert c.spec == StructuredOutputs.from_schema(SCHEMA) and c.field == "sampling.json_schema"
    with pytest.raises(InvalidRequestError) as err:
        structured.schema_text_constraint("[", "sampling.json_schema")
    assert err.value.param == "sampling.json_schema"
