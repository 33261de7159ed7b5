"""StructuredOutputs as vLLM callers build it: a JSON schema given as a dict or as its text,
choices as a list. The spec is the key of the engine's compile caches, so it must hash
whatever form the schema came in; equal schemas give equal specs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from workers import LLM, SamplingParams
from workers.structured import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def test_a_dict_schema_is_kept_as_json_text_and_hashes() -> None:
    spec = StructuredOutputs(json=SCHEMA)  # type: ignore[arg-type]
    assert spec == StructuredOutputs.from_schema(SCHEMA)
    assert isinstance(spec.json, str) and json.loads(spec.json) == SCHEMA
    assert hash(spec) == hash(StructuredOutputs.from_schema(SCHEMA))
    assert spec.kind == "json"


def test_a_json_text_schema_and_a_choice_list_hash() -> None:
    text = json.dumps(SCHEMA)
    assert hash(StructuredOutputs(json=text)) == hash(StructuredOutputs(json=text))
    listed = StructuredOutputs(choice=["yes", "no"])  # type: ignore[arg-type]
    assert listed == StructuredOutputs(choice=("yes", "no")) and hash(listed)


def test_a_bad_schema_value_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputs(json=3)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=None, kv_cache_memory_bytes=32 << 20)  # the built-in demo model


@pytest.mark.parametrize("form", ["dict", "text"])
def test_offline_generate_takes_a_dict_or_text_schema(llm: LLM, form: str) -> None:
    schema = SCHEMA if form == "dict" else json.dumps(SCHEMA)
    params = SamplingParams(
        structured_outputs=StructuredOutputs(json=schema),  # type: ignore[arg-type]
        max_tokens=32,
        temperature=0.0,
    )
    (out,) = llm.generate("Return JSON:", params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.text), SCHEMA)


# -- `after`: the grammar starts after the end-of-reasoning marker ---------------------------


def test_after_is_validated_and_a_list_becomes_a_tuple() -> None:
    spec = StructuredOutputs(regex="a+", after=[7, 8])  # type: ignore[arg-type]
    assert spec.after == (7, 8) and hash(spec)
    for bad in ([], (-1,), ("7",), (True,), (1.0,), 7):
        with pytest.raises(ValueError, match=r"^structured_outputs\.after"):
            StructuredOutputs(regex="a+", after=bad)  # type: ignore[arg-type]


def test_starting_after_is_a_copy_whose_grammar_key_drops_after() -> None:
    base = StructuredOutputs.from_schema(SCHEMA)
    late = base.starting_after([151668])
    assert late.after == (151668,) and late.json == base.json and base.after is None
    assert late != base and late.kind == "json"
    assert late.grammar_key == base and base.grammar_key is base
    assert late.starting_after((1, 2)).grammar_key == base
    with pytest.raises(ValueError, match=r"^structured_outputs\.after"):
        base.starting_after([])
