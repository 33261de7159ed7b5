"""A request cut mid-stream and resumed on another engine (workers/frontend/resume.py + the engine's
side of EngineInput.resume) gives the client exactly what an undisturbed run gives: the same
streamed deltas, the same finished output and usage, for every sampling feature that carries
state across tokens. The "death" of the first engine is an abort whose output nobody sees."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from workers import LLM, SamplingParams
from workers.core.engine import LLMEngine
from workers.frontend.resume import ResumeTracker
from workers.inputs import EngineInput, InputChecker, ResumedSample
from workers.outputs import RequestOutput, RequestOutputKind
from workers.structured import GRAMMAR_ERROR, StructuredOutputs

PROMPT = "Once upon a time"
# 40 tokens: long enough that a re-prefill can hit the prefix cache (16-token blocks).
LONG_PROMPT = list(range(300, 340))
MAX_STEPS = 500


@pytest.fixture(scope="module")
def engines(demo_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    """Two engines of the same model: the one that "dies" and a fresh one to resume on."""
    return (
        LLM(str(demo_dir), kv_cache_memory_bytes=32 << 20).engine,
        LLM(str(demo_dir), kv_cache_memory_bytes=32 << 20).engine,
    )


@pytest.fixture(autouse=True)
def _no_block_leaks(engines: tuple[LLMEngine, LLMEngine]):  # noqa: ANN202
    yield
    for eng in engines:
        assert not eng.has_unfinished()
        eng.block_manager.check_invariants()
        assert eng.block_manager.num_used_blocks == 0


_ids = iter(range(1_000_000))


def _input(eng: LLMEngine, params: SamplingParams, prompt: str | list[int] = PROMPT) -> EngineInput:
    return eng.input_checker.check_prompt(prompt, params, eng.tokenizer)


def _run(eng: LLMEngine, inp: EngineInput, tracker: ResumeTracker | None = None) -> list:
    """Runs inp to the end on eng; the outputs as the client sees them."""
    rid = f"r{next(_ids)}"
    eng.add_request(rid, inp)
    seen: list[RequestOutput] = []
    for _ in range(MAX_STEPS):  # bounded: a request the engine forgets fails, not hangs
        if not eng.has_unfinished():
            break
        for out in eng.step():
            assert out.request_id == rid
            seen.append(tracker.observe(out) if tracker is not None else out)
    assert seen and seen[-1].finished
    return seen


def _cut_run(
    first: LLMEngine, second: LLMEngine, inp: EngineInput, k: int
) -> tuple[list[RequestOutput], ResumeTracker, EngineInput]:
    """Runs inp on `first` for k outputs, kills it there (its abort output is lost), resumes
    on `second`; the outputs the client sees, the tracker, and the input that resumed."""
    tracker = ResumeTracker(inp, second.input_checker)
    rid = f"r{next(_ids)}"
    first.add_request(rid, inp)
    seen: list[RequestOutput] = []
    steps = 0
    while len(seen) < k:
        assert first.has_unfinished(), "the request ended before the cut"
        for out in first.step():
            seen.append(tracker.observe(out))
        steps += 1
        if inp.params.output_kind is RequestOutputKind.FINAL_ONLY and steps == k:
            break
    assert not any(o.finished for o in seen), "the request ended before the cut"
    first.abort(rid)  # the engine "died": the client never sees this
    nxt = tracker.resume_input()
    assert nxt is not None
    return seen + _run(second, nxt, tracker), tracker, nxt


class _Logprobs:
    """Logprobs compared the way a resume can keep them: the same tokens at every position,
    values equal to float32 rounding. The resuming engine recomputes the earlier positions' KV
    in one prefill where the undisturbed run computed them one decode at a time; the two
    round differently in the last bits (as after a preemption). The logprobs the client got
    before the cut are carried over as they were."""

    def __init__(self, lps: list | None) -> None:
        self.lps = lps

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Logprobs):
            return NotImplemented
        if self.lps is None or other.lps is None:
            return self.lps is other.lps
        return len(self.lps) == len(other.lps) and all(
            x.keys() == y.keys() and all(abs(x[t] - y[t]) <= 1e-4 for t in x)
            for x, y in zip(self.lps, other.lps, strict=True)
        )

    def __repr__(self) -> str:
        return f"_Logprobs({self.lps!r})"


def _client_view(outs: list[RequestOutput]) -> dict:
    """Everything a client gets: per sample the concatenated deltas and first finish reason,
    and the finished output's cumulative fields and usage."""
    streamed: dict[int, dict] = {}
    for out in outs:
        for c in out.outputs:
            s = streamed.setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None})
            s["text"] += c.delta_text
            s["ids"] += c.delta_token_ids
            s["lps"] += c.delta_logprobs or []
            if s["finish"] is None and c.finish_reason is not None:
                s["finish"] = (c.finish_reason, c.stop_reason)
    final = outs[-1]
    assert final.finished and final.metrics is not None
    assert [c.index for c in final.outputs] == sorted(streamed)
    for s in streamed.values():
        s["lps"] = _Logprobs(s["lps"])
    return {
        "streamed": streamed,
        "final": [
            (c.index, c.text, c.token_ids, _Logprobs(c.logprobs), c.finish_reason, c.stop_reason)
            for c in final.outputs
        ],
        "prompt_token_ids": final.prompt_token_ids,
        "usage": (final.metrics.num_prompt_tokens, final.metrics.num_generation_tokens),
    }


def _assert_exact_resume(
    engines: tuple[LLMEngine, LLMEngine], params: SamplingParams, k: int, prompt=PROMPT
) -> tuple[dict, EngineInput]:  # noqa: ANN001
    a, b = engines
    inp = _input(a, params, prompt)
    expected = _client_view(_run(b, inp))
    outs, tracker, nxt = _cut_run(a, b, inp, k)
    got = _client_view(outs)
    assert got == expected
    # What the client streamed is what the finished output says.
    for (i, text, ids, lps, *_), s in zip(got["final"], got["streamed"].values(), strict=True):
        assert (s["text"], s["ids"]) == (text, ids), i
        assert s["lps"].lps == (lps.lps or [])
    assert tracker.tokens_observed == sum(len(f[2]) for f in got["final"])
    return expected, nxt


def test_greedy(engines) -> None:  # noqa: ANN001
    expected, nxt = _assert_exact_resume(engines, SamplingParams(temperature=0.0, max_tokens=30), 7)
    assert [r.index for r in nxt.resume] == [0] and len(nxt.resume[0].output_token_ids) == 7
    assert len(expected["final"][0][2]) == 30


def test_seeded_sampling(engines) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11, max_tokens=32)
    _assert_exact_resume(engines, params, 9)


def test_penalties(engines) -> None:  # noqa: ANN001
    params = SamplingParams(
        temperature=0.9,
        seed=5,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        max_tokens=32,
    )
    _assert_exact_resume(engines, params, 10)


def test_min_tokens_spanning_the_cut(engines) -> None:  # noqa: ANN001
    a, _ = engines
    free = _run(a, _input(a, SamplingParams(temperature=0.0, max_tokens=20)))[-1].outputs[0]
    stop_token = free.token_ids[2]  # would stop the sample at its 3rd token
    params = SamplingParams(
        temperature=0.0, max_tokens=30, min_tokens=12, stop_token_ids=[stop_token]
    )
    expected, _ = _assert_exact_resume(engines, params, 6)
    assert len(expected["final"][0][2]) >= 12  # min_tokens held across the cut


def test_stop_string_held_back_across_the_cut(engines) -> None:  # noqa: ANN001
    a, _ = engines
    base = SamplingParams(temperature=0.0, max_tokens=30)
    outs = _run(a, _input(a, base))
    text = outs[-1].outputs[0].text
    # A stop string that begins 2 characters before the text streamed after output j ends and
    # completes later: once output j is in, its start is held back, and the cut comes there.
    lengths = []
    for o in outs:
        lengths.append((lengths[-1] if lengths else 0) + len(o.outputs[0].delta_text))
    j = next(
        j
        for j in range(4, 20)
        if lengths[j] - lengths[j - 1] >= 3
        and lengths[j + 1] - lengths[j] >= 3
        and text.find(text[lengths[j] - 2 : lengths[j] + 3]) == lengths[j] - 2
    )
    stop = text[lengths[j] - 2 : lengths[j] + 3]
    params = dataclasses.replace(base, stop=[stop])
    expected, nxt = _assert_exact_resume(engines, params, j + 1)
    # The cut really fell inside the stop string: its start was held back, never sent.
    assert nxt.resume[0].text_sent <= lengths[j] - 2
    assert expected["final"][0][1] == text[: lengths[j] - 2]
    assert expected["final"][0][4:] == ("stop", stop)


def test_logprobs(engines) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=1.0, seed=3, logprobs=3, max_tokens=24)
    a, b = engines
    expected, nxt = _assert_exact_resume(engines, params, 8)
    sent = nxt.resume[0].logprobs
    assert sent is not None and len(sent) == 8
    assert all(len(lp) >= 3 for lp in expected["final"][0][3].lps)
    # Before the cut the logprobs are the first engine's, exactly (carried, not recomputed).
    assert list(sent) == expected["final"][0][3].lps[:8]


def test_n3_with_a_sample_finished_before_the_cut(engines) -> None:  # noqa: ANN001
    a, _ = engines
    base = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=24, ignore_eos=True)
    free = _run(a, _input(a, base))[-1].outputs
    # Sample 0's second token as a stop token ends sample 0 there, long before the cut.
    params = dataclasses.replace(base, stop_token_ids=[free[0].token_ids[1]])
    expected, nxt = _assert_exact_resume(engines, params, 8)
    lengths = [len(f[2]) for f in expected["final"]]
    assert lengths[0] <= 2 and max(lengths) > 12, lengths  # else the case is not the one meant
    assert 0 not in [r.index for r in nxt.resume]  # finished before the cut: not resumed
    assert [f[0] for f in expected["final"]] == [0, 1, 2]
    assert expected["final"][0][4:] == ("stop", free[0].token_ids[1])


def test_json_schema(engines) -> None:  # noqa: ANN001
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0,
        seed=8,
        max_tokens=80,
        structured_outputs=StructuredOutputs.from_schema(schema),
    )
    expected, _ = _assert_exact_resume(engines, params, 6)
    index, text, ids, _, finish, _ = expected["final"][0]
    assert finish == "stop" and len(ids) > 6
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("compiled", [False, True])
def test_outputs_outside_the_grammar_end_the_request(engines, compiled: bool) -> None:  # noqa: ANN001
    a, _ = engines
    schema = {"type": "object", "properties": {"resume_check": {"type": "boolean"}}}
    params = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs.from_schema(schema))
    if compiled:  # the grammar is cached: add_request takes it at once
        a.structured.compiler.get(params.structured_outputs).result()
    bad = tuple(a.tokenizer.encode("hello"))
    inp = a.input_checker.check_resume(_input(a, params), [ResumedSample(0, bad, 0)])
    outs = _run(a, inp)
    c = outs[-1].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("abort", GRAMMAR_ERROR)
    assert c.token_ids == list(bad) and c.delta_token_ids == []


def test_final_only_resumes_as_a_rerun(engines) -> None:  # noqa: ANN001
    a, b = engines
    params = SamplingParams(
        temperature=0.8, seed=4, max_tokens=20, output_kind=RequestOutputKind.FINAL_ONLY
    )
    inp = _input(a, params)
    expected = _client_view(_run(b, inp))
    outs, tracker, nxt = _cut_run(a, b, inp, 5)
    assert nxt is inp and tracker.tokens_observed == 20
    assert _client_view(outs) == expected


def test_cut_before_the_first_token(engines) -> None:  # noqa: ANN001
    a, b = engines
    inp = _input(a, SamplingParams(temperature=0.7, seed=9, max_tokens=16))
    expected = _client_view(_run(b, inp))
    outs, _, nxt = _cut_run(a, b, inp, 0)
    assert nxt is inp  # nothing streamed: a re-run from scratch
    assert _client_view(outs) == expected


def test_resume_on_the_same_engine_hits_the_prefix_cache(engines) -> None:  # noqa: ANN001
    a, _ = engines
    inp = _input(a, SamplingParams(temperature=0.0, max_tokens=24), LONG_PROMPT)
    expected = _client_view(_run(a, inp))
    a.pop_step_token_counts()
    k = 10
    tracker = ResumeTracker(inp, a.input_checker)
    a.add_request("cut", inp)
    seen = [tracker.observe(o) for _ in range(k) for o in a.step()]
    a.abort("cut")
    nxt = tracker.resume_input()
    assert nxt is not None
    a.pop_step_token_counts()
    seen += _run(a, nxt, tracker)
    assert _client_view(seen) == expected
    # The re-prefill of prompt + 10 outputs computed only what its cached blocks lacked.
    first_step = a.pop_step_token_counts()[0]
    total = len(LONG_PROMPT) + k
    assert first_step == total - 16 * ((total - 1) // 16)
    assert seen[-1].num_cached_tokens == len(LONG_PROMPT)


def test_twice_migrated(engines) -> None:  # noqa: ANN001
    a, b = engines
    inp = _input(a, SamplingParams(temperature=0.9, seed=2, max_tokens=30, logprobs=1))
    expected = _client_view(_run(b, inp))
    tracker = ResumeTracker(inp, b.input_checker)
    seen: list[RequestOutput] = []
    cur = inp
    for eng, k in ((a, 6), (b, 7)):
        eng.add_request("mig", cur)
        seen += [tracker.observe(o) for _ in range(k) for o in eng.step()]
        eng.abort("mig")
        nxt = tracker.resume_input()
        assert nxt is not None
        cur = nxt
    assert len(cur.resume[0].output_token_ids) == 13 and tracker.attempts == 3
    seen += _run(a, cur, tracker)
    assert _client_view(seen) == expected


def test_every_sample_finished_builds_the_final_output(engines) -> None:  # noqa: ANN001
    a, _ = engines
    inp = _input(a, SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1))
    outs = _run(a, inp)
    tracker = ResumeTracker(inp)
    # The running outputs and the finished sample's last delta arrived; the finished output
    # (with its metrics) was lost.
    for o in outs[:-1]:
        tracker.observe(o)
    last = dataclasses.replace(outs[-1], finished=False, metrics=None)
    tracker.observe(last)
    assert tracker.resume_input() is None
    final = tracker.final_output()
    c, want = final.outputs[0], outs[-1].outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == (want.text, want.token_ids, "length")
    assert final.metrics is not None and final.metrics.num_generation_tokens == 5
    assert final.prompt_logprobs == outs[-1].prompt_logprobs and final.prompt_logprobs[1]


def test_resume_requires_an_original_input(engines) -> None:  # noqa: ANN001
    a, _ = engines
    inp = _input(a, SamplingParams(max_tokens=4))
    resumed = a.input_checker.check_resume(inp, [ResumedSample(0, (1, 2), 0)])
    with pytest.raises(ValueError, match="^resume"):
        ResumeTracker(resumed)


def test_engine_refuses_outputs_that_already_finished(engines) -> None:  # noqa: ANN001
    a, _ = engines
    eos = a.eos_token_ids[0]
    inp = a.input_checker.check_resume(
        _input(a, SamplingParams(max_tokens=8)), [ResumedSample(0, (5, eos), 0)]
    )
    with pytest.raises(ValueError, match=r"^resume sample 0 already finished \(stop\)"):
        a.add_request("done", inp)
    assert "done" not in a.requests


def test_engine_refuses_outputs_beyond_its_limits(engines) -> None:  # noqa: ANN001
    # Checked against another engine's (larger) limits: this engine's replay refuses it, since
    # max_model_len (capped to the KV cache) ends the sample before it could outgrow the cache.
    a, _ = engines
    big = InputChecker(a.vocab_size, max_model_len=1 << 20)
    inp = big.check([5] * 8, SamplingParams(max_tokens=None, ignore_eos=True))
    outputs = (7,) * (a.max_model_len - 8)
    resumed = big.check_resume(inp, [ResumedSample(0, outputs, 0)])
    with pytest.raises(ValueError, match=r"^resume sample 0 already finished \(length\)"):
        a.add_request("long", resumed)
    assert "long" not in a.requests
    # One token less leaves room for one more: it runs, and ends at max_model_len.
    fits = big.check_resume(inp, [ResumedSample(0, outputs[:-1], 0)])
    c = _run(a, fits)[-1].outputs[0]
    assert (c.finish_reason, len(c.token_ids)) == ("length", a.max_model_len - 8)
