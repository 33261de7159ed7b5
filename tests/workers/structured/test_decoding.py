"""Constrained decoding end to end with the offline LLM on the demo model, whose unconstrained
output is near-random: every valid output below is the constraint's doing."""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import jsonschema
import pytest

from tests.workers.structured.schemas import random_schema
from workers import LLM, SamplingParams
from workers.inputs import InputChecker
from workers.structured import GRAMMAR_ERROR, StructuredOutputs

PROMPTS = ["Return JSON:", "The answer is", "Once upon a time", "{"]


@pytest.fixture(scope="module")
def llm(demo_dir: Path) -> LLM:
    return LLM(str(demo_dir), kv_cache_memory_bytes=32 << 20)


def _json_params(schema: dict, **kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(structured_outputs=StructuredOutputs.from_schema(schema), **kw)


def _check_json(outputs, schemas, max_tokens: int) -> int:  # noqa: ANN001
    """Every finished output validates; truncated ones stopped at max_tokens. Returns how
    many finished."""
    stopped = 0
    for c, schema in zip(outputs, schemas, strict=True):
        if c.finish_reason == "length":
            assert len(c.token_ids) == max_tokens
            continue
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), schema)
        stopped += 1
    return stopped


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_generated_schemas_produce_valid_json(llm: LLM, sampling: str) -> None:
    rng = random.Random(1234 if sampling == "greedy" else 99)
    schemas = [random_schema(rng) for _ in range(12)]
    params = [
        _json_params(
            s,
            max_tokens=160,
            temperature=0.0 if sampling == "greedy" else 1.0,
            seed=None if sampling == "greedy" else i,
        )
        for i, s in enumerate(schemas)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stopped = _check_json([o.outputs[0] for o in outs], schemas, 160)
    assert stopped >= 10  # short strings and arrays: nearly all finish well within 160


def test_n_samples_each_follow_the_schema(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {
            "label": {"enum": ["cat", "dog", "bird"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["label", "score", "tags"],
        "additionalProperties": False,
    }
    [out] = llm.generate(
        ["Classify:"], _json_params(schema, n=4, temperature=1.0, seed=7, max_tokens=120)
    )
    assert len(out.outputs) == 4
    assert _check_json(out.outputs, [schema] * 4, 120) == 4
    assert len({c.text for c in out.outputs}) > 1  # each sample its own matcher and draws


@pytest.mark.parametrize(
    "pattern",
    [
        r"[0-9]{3}-[0-9]{4}",
        r"(cat|dog)s? (and|or) (bird|fish)",
        r"[a-z]{2,6}@[a-z]{3,5}\.(com|org)",
    ],
)
def test_regex_outputs_full_match(llm: LLM, pattern: str) -> None:
    params = SamplingParams(
        structured_outputs=StructuredOutputs(regex=pattern),
        n=3,
        temperature=1.0,
        seed=3,
        max_tokens=40,
    )
    [out] = llm.generate(["Write:"], params)
    for c in out.outputs:
        assert c.finish_reason == "stop"
        assert re.fullmatch(pattern, c.text), c.text


def test_choice_outputs_are_one_of_the_choices(llm: LLM) -> None:
    choices = ("positive", "negative", "neutral", "it depends")
    spec = StructuredOutputs(choice=choices)
    params = [
        SamplingParams(structured_outputs=spec, temperature=1.0, seed=s, max_tokens=20)
        for s in range(8)
    ]
    outs = llm.generate(["Sentiment:"] * 8, params, use_tqdm=False)
    for o in outs:
        [c] = o.outputs
        assert c.text in choices and c.finish_reason == "stop"


def test_json_object_and_lark_grammar(llm: LLM) -> None:
    obj = SamplingParams(
        structured_outputs=StructuredOutputs(json_object=True), temperature=0.0, max_tokens=200
    )
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    lark = SamplingParams(
        structured_outputs=StructuredOutputs(grammar=grammar), temperature=0.0, max_tokens=60
    )
    a, b = llm.generate(["Object:", "Sum:"], [obj, lark], use_tqdm=False)
    if a.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(a.outputs[0].text), dict)
    else:
        assert a.outputs[0].text.startswith("{")
    assert b.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", b.outputs[0].text)


def test_complete_grammar_stops_without_eos_and_max_tokens_gives_length(llm: LLM) -> None:
    done = SamplingParams(
        structured_outputs=StructuredOutputs(choice=("yes",)), temperature=0.0, max_tokens=30
    )
    long = _json_params(
        {"type": "array", "items": {"type": "integer"}, "minItems": 50}, max_tokens=6
    )
    a, b = llm.generate(["Q:", "Q:"], [done, long], use_tqdm=False)
    [ca], [cb] = a.outputs, b.outputs
    assert (ca.text, ca.finish_reason) == ("yes", "stop")
    assert not set(ca.token_ids) & set(llm.engine.eos_token_ids)  # ended by the grammar
    assert cb.finish_reason == "length" and len(cb.token_ids) == 6
    assert cb.text.startswith("[")


def test_stop_strings_apply_to_constrained_output(llm: LLM) -> None:
    params = SamplingParams(
        structured_outputs=StructuredOutputs(regex=r"(ab){3}c(ab){3}"),
        stop=["c"],
        temperature=0.0,
        max_tokens=40,
    )
    [out] = llm.generate(["Go:"], params)
    [c] = out.outputs
    assert (c.text, c.finish_reason, c.stop_reason) == ("ababab", "stop", "c")


def test_unconstrained_rows_are_untouched_in_a_mixed_batch(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Mixed batch prompt"], plain, use_tqdm=False)[0].outputs[0].token_ids
    constrained = _json_params({"type": "object"}, temperature=0.0, max_tokens=24)
    mixed = llm.generate(
        ["Mixed batch prompt", "Other", "Mixed batch prompt"],
        [plain, constrained, plain],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[2].outputs[0].token_ids == alone


# -- the engine around the grammar: preemption, chunking, prefix cache, compile failures ------


def _long_specs() -> list[SamplingParams]:
    """Constrained requests long enough to compete for a tiny cache."""
    arr = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 25,
        "maxItems": 25,
    }
    words = StructuredOutputs(regex=r"([a-z]{2,5} ){20}end")
    out = []
    for i in range(6):
        spec = StructuredOutputs.from_schema(arr) if i % 2 else words
        greedy = i % 3 == 0
        out.append(
            SamplingParams(
                structured_outputs=spec,
                temperature=0.0 if greedy else 1.0,
                seed=None if greedy else i,
                max_tokens=110,
            )
        )
    return out


def _texts(llm: LLM, prompts, params) -> list[tuple[str, str]]:  # noqa: ANN001
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_preempted_constrained_requests_match_undisturbed_ones(demo_dir: Path) -> None:
    prompts = [f"Request number {i}: " + "x " * (5 + i) for i in range(6)]
    params = _long_specs()
    ample = _texts(LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20), prompts, params)
    # 64 KiB per block for the demo model: 16 blocks = 256 tokens for 6 sequences of ~80.
    tight = LLM(str(demo_dir), kv_cache_memory_bytes=16 * 65536)
    assert _texts(tight, prompts, params) == ample
    assert tight.stats().num_preemptions > 0
    for text, reason in ample:
        assert reason == "stop"
        assert text.endswith("end") or len(json.loads(text)) == 25


def test_chunked_prefill_and_prefix_cache_give_the_same_constrained_output(demo_dir) -> None:  # noqa: ANN001
    prefix = "A long shared preamble that spans several KV blocks. " * 6
    prompts = [prefix + f"Question {i}?" for i in range(4)]
    params = _long_specs()[:4]
    plain = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    expected = _texts(plain, prompts, params)
    chunked = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32)
    assert _texts(chunked, prompts, params) == expected
    assert chunked.stats().prefix_cache_hits > 0


def _drain(llm: LLM, max_steps: int = 2000) -> dict:
    done = {}
    for _ in range(max_steps):
        if not llm.engine.has_unfinished():
            return done
        done.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    raise AssertionError("still running")


def _trusted(llm: LLM, prompt: str, params: SamplingParams):  # noqa: ANN202
    """An EngineInput past the ingress (which would refuse a bad grammar)."""
    checker = InputChecker(llm.engine.vocab_size, llm.engine.max_model_len)
    return checker.check(llm.tokenizer.encode(prompt), params)


def test_failing_grammar_ends_its_request_and_not_the_others(llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputs(grammar="start: nowhere"), n=2)
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.engine.add_request("bad", _trusted(llm, "Hi", bad))
    llm.engine.add_request("good", _trusted(llm, "Hi", good))
    done = _drain(llm)
    assert [c.finish_reason for c in done["bad"].outputs] == ["abort", "abort"]
    assert {c.stop_reason for c in done["bad"].outputs} == {GRAMMAR_ERROR}
    assert len(done["good"].outputs[0].token_ids) == 5


def test_request_waiting_for_its_grammar_does_not_block_others(llm: LLM) -> None:
    gate = threading.Event()
    # Hold the compile thread: the constrained request's grammar cannot be ready until set.
    held = llm.engine.structured.compiler._executor().submit(gate.wait)
    try:
        spec = StructuredOutputs(regex=r"waiting-[0-9]{2}")
        llm.engine.add_request(
            "slow", _trusted(llm, "Hi", SamplingParams(structured_outputs=spec, max_tokens=20))
        )
        plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.engine.add_request("fast", _trusted(llm, "Hello", plain))
        done: dict = {}
        while "fast" not in done:
            done.update((o.request_id, o) for o in llm.engine.step() if o.finished)
        assert len(done["fast"].outputs[0].token_ids) == 8
        slow = llm.engine.requests["slow"]
        assert slow.seqs[0].grammar_pending and slow.seqs[0].num_output_tokens == 0
    finally:
        gate.set()
        held.result()
    done = _drain(llm)
    assert re.fullmatch(r"waiting-[0-9]{2}", done["slow"].outputs[0].text)


def test_grammar_not_ready_within_the_timeout_ends_the_request(demo_dir: Path) -> None:
    llm = LLM(str(demo_dir), kv_cache_memory_bytes=8 << 20, grammar_timeout_s=0.05)
    gate = threading.Event()
    held = llm.engine.structured.compiler._executor().submit(gate.wait)
    try:
        spec = StructuredOutputs(regex=r"never-[0-9]")
        params = SamplingParams(structured_outputs=spec, max_tokens=5)
        llm.engine.add_request("late", _trusted(llm, "Hi", params))
        done = _drain(llm, max_steps=10_000)  # idle steps wait on the compile, not spin
    finally:
        gate.set()
        held.result()
    [c] = done["late"].outputs
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("abort", GRAMMAR_ERROR, [])
    llm.engine.shutdown()


def test_invalid_specs_are_refused_before_anything_runs(llm: LLM) -> None:
    before = llm.stats().num_steps
    good = SamplingParams(max_tokens=4)
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed"))
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex is not a valid regex"):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    schema = StructuredOutputs.from_schema({"type": "object", "dependentSchemas": {"a": {}}})
    with pytest.raises(ValueError, match=r"^structured_outputs\.json .*dependentSchemas"):
        llm.engine.add_prompt("r", "a", SamplingParams(structured_outputs=schema))
    assert llm.stats().num_steps == before and not llm.engine.has_unfinished()


def test_stats_count_structured_requests_and_cache_hits(llm: LLM) -> None:
    spec = StructuredOutputs(regex=r"stats-[0-9]")
    s0 = llm.stats()
    llm.generate(["a"], SamplingParams(structured_outputs=spec, max_tokens=8), use_tqdm=False)
    llm.generate(["b"], SamplingParams(structured_outputs=spec, max_tokens=8), use_tqdm=False)
    s1 = llm.stats()
    assert s1.structured_requests - s0.structured_requests == 2
    assert s1.grammar_cache_hits - s0.grammar_cache_hits == 1
    assert s1.grammar_compiles - s0.grammar_compiles == 1
    assert s1.grammar_compile_seconds > s0.grammar_compile_seconds


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_streamed_constrained_output_through_both_engine_cores(demo_dir, process: bool) -> None:  # noqa: ANN001
    import asyncio

    from workers import AsyncEngine
    from workers.config import EngineArgs

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
            "temp": {"type": "integer", "minimum": -40, "maximum": 50},
        },
        "required": ["city", "temp"],
        "additionalProperties": False,
    }
    params = _json_params(schema, n=2, temperature=1.0, seed=5, max_tokens=80)
    eng = AsyncEngine(
        EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=8 << 20), process=process
    )

    async def main():  # noqa: ANN202
        return [o async for o in eng.generate("Weather:", params, "s")]

    try:
        outs = asyncio.run(main())
        stats = eng.stats()
    finally:
        eng.shutdown()
    last = outs[-1]
    assert last.finished and len(outs) > 2
    for c in last.outputs:
        streamed = "".join(d.delta_text for o in outs for d in o.outputs if d.index == c.index)
        assert streamed == c.text and c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    assert stats.structured_requests == 1 and stats.grammar_compiles == 1
