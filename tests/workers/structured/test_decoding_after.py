"""StructuredDecoding with `StructuredOutputs.after`: the grammar is dormant (no mask row, its
matcher not fed, the sequence never stopped by it) until the outputs end with the marker's
ids, then applies exactly as a grammar without `after` does; resumed samples replay to the
same state. Driven by hand over the demo tokenizer, then once end to end with the demo model."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from workers import LLM, SamplingParams
from workers.core.request import Request, Seq
from workers.structured import StructuredOutputs
from workers.structured.compiler import GrammarCompiler
from workers.structured.decoding import StructuredDecoding

D, DASH = 25, 15  # the demo tokenizer's "7" and "-"
DIGIT_DASH_DIGIT = r"[0-9]-[0-9]"
FREE = [DASH, 90, 67, 671, DASH]  # "-", "x", "a", " x": refused first, free while dormant


def _request(
    dec: StructuredDecoding,
    spec: StructuredOutputs,
    outputs: tuple[list[int], ...] = ([],),
    prompt: tuple[int, ...] = (5, 6, 7),
) -> tuple[Request, list[tuple[Request, str]]]:
    """A request with one sample per `outputs` (earlier outputs: a resumed request), added
    and its grammar ready; returns it and the failures poll reported."""
    params = SamplingParams(structured_outputs=spec, n=len(outputs), max_tokens=100)
    seqs = [
        Seq(f"r-{i}", "r", i, list(prompt), params, token_ids=[*prompt, *out])
        for i, out in enumerate(outputs)
    ]
    req = Request("r", None, list(prompt), params, seqs, arrival_time=0.0)
    dec.add(req)
    failed = list(dec._failed)
    dec._failed.clear()
    while dec.has_pending:
        dec.wait(5.0)
        failed += dec.poll()
    return req, failed


def _sample(dec: StructuredDecoding, seq: Seq, token: int) -> bool:
    """What the engine does with a sampled token: append it, then advance the grammar."""
    seq.token_ids.append(token)
    return dec.accept(seq, token)


def _mask(dec: StructuredDecoding, *seqs: Seq) -> dict[str, np.ndarray]:
    """The mask rows this step gives `seqs` (each decoding one token), by seq id."""
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    m = dec.bitmask([(s, 1) for s in seqs])
    return {} if m is None else dict(zip(m.seq_ids, m.bits, strict=True))


def _allows(row: np.ndarray, token: int) -> bool:
    return bool(row[token // 32] & np.int32(1 << (token % 32)))


@pytest.mark.parametrize("marker", [(1131,), (1131, 425, 262, 77, 32)], ids=["one", "several"])
def test_dormant_until_the_marker_then_the_grammar_applies_and_stops(
    dec: StructuredDecoding, marker: tuple[int, ...]
) -> None:
    plain, _ = _request(dec, StructuredOutputs(regex=DIGIT_DASH_DIGIT))
    req, failed = _request(dec, StructuredOutputs(regex=DIGIT_DASH_DIGIT, after=marker))
    [seq], [ref] = req.seqs, plain.seqs
    assert not failed and not seq.grammar_pending and seq.grammar_after == marker
    # Dormant: no mask row (the unconstrained row beside it keeps its own), nothing consumed,
    # a marker's prefix (or its last id alone) does not wake it.
    for token in [*FREE, *marker[:-1], DASH, marker[-1] if len(marker) > 1 else DASH]:
        assert set(_mask(dec, seq, ref)) == {ref.seq_id}
        assert not _sample(dec, seq, token)
    assert seq.grammar.num_consumed == 0 and seq.grammar_after == marker
    for token in marker:
        assert set(_mask(dec, seq)) == set() and not _sample(dec, seq, token)
    assert seq.grammar_after is None and seq.grammar.num_consumed == 0
    # Awake: the same mask as a fresh grammar, then the grammar's own stop.
    row = _mask(dec, seq)[seq.seq_id]
    assert np.array_equal(row, _mask(dec, ref)[ref.seq_id])
    assert _allows(row, D) and not _allows(row, DASH)
    assert not _sample(dec, seq, D)
    row = _mask(dec, seq)[seq.seq_id]
    assert _allows(row, DASH) and not _allows(row, D)
    assert not _sample(dec, seq, DASH)
    assert _sample(dec, seq, D)  # "7-7" completes the grammar: the sequence stops
    assert seq.grammar.is_terminated and seq.grammar.num_consumed == 3


def test_a_grammar_refusing_token_after_the_marker_still_stops_the_sequence(
    dec: StructuredDecoding,
) -> None:
    req, _ = _request(dec, StructuredOutputs(regex=DIGIT_DASH_DIGIT, after=(1131,)))
    [seq] = req.seqs
    assert not _sample(dec, seq, 1131)
    assert _sample(dec, seq, DASH)  # only an unmasked sampler could: it does not run on free


def test_a_sequence_that_never_emits_the_marker_is_never_constrained(
    dec: StructuredDecoding,
) -> None:
    req, _ = _request(dec, StructuredOutputs(choice=("yes",), after=(1131, 425)))
    [seq] = req.seqs
    for token in FREE * 10 + [425, 1131, 1131, 77]:
        assert _mask(dec, seq) == {} and not _sample(dec, seq, token)
    assert seq.grammar_after == (1131, 425) and seq.grammar.num_consumed == 0


def test_the_marker_counts_in_the_outputs_only(dec: StructuredDecoding) -> None:
    # The prompt ends with the marker's first id: the first output completing it in the
    # whole token list does not wake the grammar.
    spec = StructuredOutputs(regex=DIGIT_DASH_DIGIT, after=(1131, 425))
    req, _ = _request(dec, spec, prompt=(5, 1131))
    [seq] = req.seqs
    assert not _sample(dec, seq, 425) and seq.grammar_after == (1131, 425)


def test_replay_of_resumed_samples_before_and_after_the_marker(dec: StructuredDecoding) -> None:
    m = (1131, 425)
    outputs = (
        [*FREE],  # still reasoning
        [*FREE, *m],  # the marker just ended
        [*FREE, 1131, *m, D],  # one token of the answer (a stray marker id before it)
        [*m, D, *m],  # the marker again, inside the answer: fed to the grammar
    )
    spec = StructuredOutputs(regex=DIGIT_DASH_DIGIT, after=m)
    # Sample 3's answer does not fit (the marker is no longer free): the request fails.
    _, failed = _request(dec, spec, outputs)
    assert [why for _, why in failed] == [
        "resumed sample 3: output 3 (token 1131) is outside its grammar"
    ]
    # Without it, the others resume where they were.
    req, failed = _request(dec, spec, outputs[:3])
    assert not failed and not any(s.grammar_pending for s in req.seqs)
    s0, s1, s2 = req.seqs
    assert (s0.grammar_after, s0.grammar.num_consumed) == (m, 0)
    assert (s1.grammar_after, s1.grammar.num_consumed) == (None, 0)
    assert (s2.grammar_after, s2.grammar.num_consumed) == (None, 1)
    assert _mask(dec, s0) == {}
    row = _mask(dec, s1)[s1.seq_id]
    assert _allows(row, D) and not _allows(row, DASH)
    assert not _sample(dec, s2, DASH) and _sample(dec, s2, D)


def test_replayed_outputs_that_complete_the_grammar_after_the_marker_fail(
    dec: StructuredDecoding,
) -> None:
    spec = StructuredOutputs(regex=DIGIT_DASH_DIGIT, after=(1131,))
    _, failed = _request(dec, spec, ([DASH, 1131, D, DASH, D],))
    assert len(failed) == 1 and "already complete the grammar" in failed[0][1]


def test_specs_differing_only_in_after_share_one_compile(compiler: GrammarCompiler) -> None:
    spec = StructuredOutputs(regex=r"shared-[0-9]{2}")
    s0 = compiler.stats()
    first = compiler.get(spec.starting_after([1131]))
    assert compiler.get(spec) is first
    assert compiler.get(spec.starting_after([1131, 425])) is first
    first.result()
    s1 = compiler.stats()
    assert (s1.cache_misses - s0.cache_misses, s1.cache_hits - s0.cache_hits) == (1, 2)


# -- end to end: the demo model reasons freely, then answers under the grammar ---------------


def test_engine_output_is_free_until_the_marker_then_follows_the_regex(demo_dir: Path) -> None:
    llm = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20)
    prompt = "Think first, then answer:"
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    [ref] = llm.generate([prompt], free, use_tqdm=False)[0].outputs
    ids = list(ref.token_ids)
    # The marker: two ids the greedy run emits early, at their first occurrence.
    end = next(e for e in range(4, 12) if _first_end(ids, tuple(ids[e - 2 : e])) == e)
    marker = tuple(ids[end - 2 : end])
    pattern = r"[0-9]{3}-[a-z]{2}"
    spec = StructuredOutputs(regex=pattern).starting_after(marker)
    params = SamplingParams(structured_outputs=spec, temperature=0.0, max_tokens=60)
    [c] = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert c.token_ids[:end] == ids[:end]  # the reasoning: exactly the unconstrained run's
    assert c.finish_reason == "stop"  # ended by the grammar
    assert re.fullmatch(pattern, llm.tokenizer.decode(c.token_ids[end:])), c.text
    assert c.text.endswith(llm.tokenizer.decode(c.token_ids[end:]))
    llm.engine.shutdown()


def _first_end(ids: list[int], marker: tuple[int, ...]) -> int:
    k = len(marker)
    return next(e for e in range(k, len(ids) + 1) if tuple(ids[e - k : e]) == marker)
