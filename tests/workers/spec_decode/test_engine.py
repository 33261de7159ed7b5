"""Speculative decoding in the engine (workers/core/speculator.py, the worker's verifying
chunk): outputs identical to plain decoding, with drafts accepted and rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.spec_decode.oracle import OracleProposer, reference_of
from workers import LLM, SamplingParams

FIXED = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7"]


@pytest.fixture(scope="module")
def plain(demo_dir: Path) -> LLM:
    return LLM(str(demo_dir), kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def spec(demo_dir: Path) -> LLM:
    return LLM(str(demo_dir), kv_cache_memory_bytes=64 << 20, speculative_config=FIXED)


def _with_oracle(spec: LLM, plain: LLM, prompts: list, params: SamplingParams) -> tuple:
    ref = plain.generate(prompts, params, use_tqdm=False)
    spec.engine.speculator.proposer = OracleProposer(reference_of(ref), spec.engine.vocab_size)
    before = spec.stats()
    out = spec.generate(prompts, params, use_tqdm=False)
    return ref, out, before, spec.stats()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=1.0, seed=7),
        SamplingParams(max_tokens=33, temperature=0.8, top_p=0.9, seed=3, n=2, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, min_tokens=20, logprobs=0),
    ],
    ids=["greedy", "seeded", "n2-logprobs", "min-tokens"],
)
def test_outputs_are_the_plain_engines_with_drafts_accepted_and_rejected(
    spec: LLM, plain: LLM, params: SamplingParams
) -> None:
    ref, out, before, after = _with_oracle(spec, plain, PROMPTS, params)
    for r, o in zip(ref, out, strict=True):
        for rc, oc in zip(r.outputs, o.outputs, strict=True):
            assert oc.token_ids == rc.token_ids
            assert oc.text == rc.text
            assert oc.finish_reason == rc.finish_reason
            if rc.logprobs is not None:  # the target's, computed in a chunk: rounding only
                for lr, lo in zip(rc.logprobs, oc.logprobs, strict=True):
                    assert lr.keys() == lo.keys()
                    assert all(abs(lr[t] - lo[t]) < 1e-4 for t in lr)
    drafts = after.spec_decode_drafts - before.spec_decode_drafts
    proposed = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    assert drafts > 0 and 0 < accepted < proposed  # both paths ran
    # Each draft accepted a prefix: position i's count never exceeds position i-1's.
    per_position = after.spec_decode_accepted_per_position
    assert list(per_position) == sorted(per_position, reverse=True)
    # Fewer steps than tokens: the accepted drafts' tokens came without steps of their own.
    assert after.kv_blocks_used == 0  # every block came back


def test_a_stop_string_inside_an_accepted_run_ends_the_output_there(spec: LLM, plain: LLM) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    full = plain.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2 :][:6]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop])
    ref, out, _, after = _with_oracle(spec, plain, PROMPTS[:1], params)
    assert out[0].outputs[0].text == ref[0].outputs[0].text
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert out[0].outputs[0].finish_reason == "stop"
    assert after.kv_blocks_used == 0


def test_max_tokens_is_exact_when_drafts_could_run_past_it(spec: LLM, plain: LLM) -> None:
    for max_tokens in (1, 2, 3, 5, 6):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ref, out, _, _ = _with_oracle(spec, plain, PROMPTS, params)
        for r, o in zip(ref, out, strict=True):
            assert o.outputs[0].token_ids == r.outputs[0].token_ids
            assert len(o.outputs[0].token_ids) == max_tokens


def test_preemption_and_async_scheduling_keep_the_output(demo_dir: Path) -> None:
    """A cache of a few blocks preempts sequences mid-speculation; async scheduling makes the
    verifying steps host-bound. Outputs stay the plain engine's; every block comes back."""
    prompts = [f"{i} {PROMPTS[i % 3]} and {i}" for i in range(8)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    small = {"kv_cache_memory_bytes": 1200 << 10, "max_model_len": 96}
    plain = LLM(str(demo_dir), **small)
    try:
        for extra in ({}, {"async_scheduling": True}):
            spec = LLM(str(demo_dir), speculative_config=FIXED, **small, **extra)
            try:
                ref, out, _, after = _with_oracle(spec, plain, prompts, params)
                assert [o.outputs[0].token_ids for o in out] == [
                    r.outputs[0].token_ids for r in ref
                ]
                assert after.num_preemptions > 0 and after.spec_decode_accepted_tokens > 0
                assert after.kv_blocks_used == 0
            finally:
                spec.engine.shutdown()
    finally:
        plain.engine.shutdown()


def test_ngram_drafts_are_accepted_on_repeating_output(tmp_path: Path) -> None:
    """A small random-weight model (std 0.02, as a fresh initialisation) falls into repeating
    runs when greedy, where prompt lookup finds its drafts: output identical, most drafts
    accepted, fewer steps."""
    from cluster.bench.common.random_model import random_model_dir

    path = str(random_model_dir("qwen3-tiny", "float32", cache_root=tmp_path))
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [100, 200, 300, 400], [7] * 12]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    plain = LLM(path, kv_cache_memory_bytes=16 << 20)
    spec = LLM(path, kv_cache_memory_bytes=16 << 20, speculative_config=FIXED)
    try:
        ref = plain.generate(prompts, params, use_tqdm=False)
        out = spec.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]
        st = spec.stats()
        assert st.spec_decode_accepted_tokens > st.spec_decode_draft_tokens / 2
        # Each verifying step yields 1 + its accepted tokens: fewer steps than plain decoding.
        assert st.num_steps < plain.stats().num_steps
    finally:
        plain.engine.shutdown()
        spec.engine.shutdown()


def test_streamed_deltas_carry_every_token_of_a_verifying_step_in_order(
    spec: LLM, plain: LLM
) -> None:
    from workers.outputs import RequestOutputKind

    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref, _, _, _ = _with_oracle(spec, plain, PROMPTS[:1], params)
    engine = spec.engine
    engine.add_prompt("s", PROMPTS[0], params.derived(output_kind=RequestOutputKind.DELTA))
    tokens: list[int] = []
    text, sizes = "", []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            sizes.append(len(out.outputs[0].token_ids))
    assert tokens == ref[0].outputs[0].token_ids and text == ref[0].outputs[0].text
    assert max(sizes) > 1  # some step brought several tokens


@pytest.mark.parametrize("cut", [1, 7, 13])
def test_a_sample_resumed_mid_stream_continues_token_exact(spec: LLM, plain: LLM, cut: int) -> None:
    """Migration: the outputs an engine streamed (wherever a verifying step left them) resume
    on another engine that speculates, and the sample goes on as it would have (seeded)."""
    import dataclasses

    from workers.inputs import ResumedSample

    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    ref, _, _, _ = _with_oracle(spec, plain, PROMPTS[:1], params)
    whole = ref[0].outputs[0].token_ids
    eng = spec.engine
    inp = eng.input_checker.check_prompt(PROMPTS[0], params, eng.tokenizer)
    earlier = tuple(whole[:cut])
    inp = dataclasses.replace(inp, resume=(ResumedSample(0, earlier, text_sent=0),))
    before = spec.stats().spec_decode_accepted_tokens
    eng.add_request(f"resumed-{cut}", inp)
    seq = eng.requests[f"resumed-{cut}"].seqs[0]
    while eng.has_unfinished():
        eng.step()
    assert seq.output_token_ids == whole
    assert spec.stats().spec_decode_accepted_tokens > before


def test_a_draft_model_proposes_and_the_output_stays_the_targets(tmp_path: Path) -> None:
    """A checkpoint drafts for a target of the same vocabulary (here the same checkpoint, so
    that acceptance is known): outputs identical, greedy and seeded."""
    from cluster.bench.common.random_model import random_model_dir

    target = str(random_model_dir("qwen3-tiny", "float32", cache_root=tmp_path / "t"))
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [100, 200, 300, 400], [7] * 12]
    config = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    plain = LLM(target, kv_cache_memory_bytes=16 << 20)
    spec = LLM(target, kv_cache_memory_bytes=16 << 20, speculative_config=config)
    try:
        for params in (
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True),
        ):
            ref = plain.generate(prompts, params, use_tqdm=False)
            out = spec.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]
            if params.temperature == 0.0:
                # The draft is the target itself here: its greedy drafts are the target's.
                st = spec.stats()
                assert st.spec_decode_accepted_tokens >= 0.9 * st.spec_decode_draft_tokens > 0
        assert spec.stats().kv_blocks_used == 0
    finally:
        plain.engine.shutdown()
        spec.engine.shutdown()


def test_a_draft_model_with_another_vocabulary_is_refused(demo_dir: Path, tmp_path: Path) -> None:
    from cluster.bench.common.random_model import random_model_dir

    other = str(random_model_dir("qwen3-tiny", "float32", cache_root=tmp_path))
    config = {"method": "draft_model", "model": other, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, speculative_config=config)
