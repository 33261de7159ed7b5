"""Continuous batching: prefix caching, preemption, chunked prefill, abort, fairness."""

from __future__ import annotations

import random

from tests.checkpoints import hf_greedy, load_hf
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams
from workers.config import EngineArgs
from workers.core.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 3800) for _ in range(n)]


def _run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_prefix_caching_on_off_identical_and_hits(demo_dir) -> None:
    prefix = _ids(128, 0)
    prompts = [prefix + _ids(8, i + 1) for i in range(8)]
    on = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20)
    first = _run(on, prompts[:1])
    before = on.stats()
    rest = _run(on, prompts[1:])
    after = on.stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 0.9 * 128 * 7, f"only {hits} of {128 * 7} shared prefix tokens hit"
    off = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    assert _run(off, prompts) == first + rest
    assert off.stats().prefix_cache_hits == 0
    hf = load_hf(demo_dir)
    for p, o in list(zip(prompts, first + rest, strict=True))[:3]:
        assert_greedy_match(hf, p, o, hf_greedy(hf, p, 12))


def test_preemption_keeps_outputs_identical(demo_dir) -> None:
    prompts = [_ids(40 + 7 * i, 10 + i) for i in range(12)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ample = _run(LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20), prompts, params)
    # 64 KiB per block for the demo model: 24 blocks = 384 tokens for 12 sequences of ~150.
    tight = LLM(str(demo_dir), kv_cache_memory_bytes=24 * 65536)
    assert tight.engine.block_manager.num_blocks == 24
    assert _run(tight, prompts, params) == ample
    assert tight.stats().num_preemptions > 0
    assert tight.stats().kv_blocks_used == 0


def test_seeded_sampling_survives_preemption(demo_dir) -> None:
    prompts = [_ids(60, 30 + i) for i in range(10)]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(10)
    ]
    ample = _run(LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20), prompts, params)
    tight = LLM(str(demo_dir), kv_cache_memory_bytes=20 * 65536)
    assert _run(tight, prompts, params) == ample
    assert tight.stats().num_preemptions > 0


def test_prompt_that_can_never_fit_fails_at_once(demo_dir) -> None:
    llm = LLM(str(demo_dir), kv_cache_memory_bytes=4 * 65536)  # 64 tokens of KV
    import pytest

    # Checked at the edge: max_model_len was capped to the cache, and the error names it.
    with pytest.raises(ValueError, match=r"^prompt .*KV cache's capacity of 64 tokens"):
        llm.generate([_ids(100, 1)], GREEDY, use_tqdm=False)
    # A trusted input past that check is still refused by the engine, before it runs.
    from workers.inputs import InputChecker

    inp = InputChecker(llm.engine.vocab_size, 4096).check(_ids(100, 1), GREEDY)
    with pytest.raises(ValueError, match="never fit"):
        llm.engine.add_request("too-long", inp)
    assert not llm.engine.has_unfinished()


def test_chunked_prefill_identical(demo_dir) -> None:
    prompts = [_ids(n, n) for n in (300, 45, 170, 9)]
    ref = _run(LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20), prompts)
    small = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32)
    assert _run(small, prompts) == ref
    assert max(small.engine.pop_step_token_counts()) <= 32


def test_abort_at_random_points_frees_everything(demo_dir) -> None:
    prompts = [_ids(5 + (i * 37) % 200, 100 + i) for i in range(100)]
    params = [
        SamplingParams(max_tokens=4 + i % 20, temperature=0.0, ignore_eos=True) for i in range(100)
    ]
    args = EngineArgs(
        model=str(demo_dir), kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=256
    )
    ref_engine = LLMEngine.from_args(args)
    ref = {}
    for i in range(100):
        ref_engine.add_prompt(str(i), prompts[i], params[i])
    while ref_engine.has_unfinished():
        for out in ref_engine.step():
            ref[out.request_id] = out.outputs[0].token_ids

    engine = LLMEngine.from_args(args)
    rng = random.Random(0)
    for i in range(100):
        engine.add_prompt(str(i), prompts[i], params[i])
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        live = list(engine.requests)
        for rid in rng.sample(live, k=min(len(live), rng.choice([0, 0, 1, 3]))):
            if rng.random() < 0.5:
                out = engine.abort(rid)
                assert out is not None and out.finished
                assert all(c.finish_reason in ("abort", "length") for c in out.outputs)
                aborted.add(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert 10 < len(aborted) < 90
    for rid, toks in done.items():
        assert toks == ref[rid]
    assert set(done) | aborted == {str(i) for i in range(100)}
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_requests_running == 0
    assert stats.num_requests_waiting == 0
    engine.block_manager.check_invariants()


def test_long_prompt_does_not_starve_decodes(demo_dir) -> None:
    engine = LLMEngine.from_args(
        EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=256)
    )
    p = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_prompt(f"d{i}", _ids(20, i), p)
    for _ in range(3):  # all 8 are decoding now
        engine.step()
    engine.add_prompt("long", _ids(2000, 99), SamplingParams(max_tokens=4, ignore_eos=True))
    steps_with_long_prefill = 0
    while "long" in engine.requests and engine.seqs["long#0"].num_computed_tokens < 2000:
        before = {
            f"d{i}": engine.seqs[f"d{i}#0"].num_output_tokens
            for i in range(8)
            if f"d{i}#0" in engine.seqs
        }
        engine.step()
        steps_with_long_prefill += 1
        for sid, n in before.items():
            seq = engine.seqs.get(sid + "#0")
            if seq is not None:  # still running: it must have got a token this step
                assert seq.num_output_tokens == n + 1, f"{sid} starved for a step"
    assert steps_with_long_prefill >= 2000 // 256  # the prompt really was chunked


def _finish_order(engine: LLMEngine) -> list[str]:
    order: list[str] = []
    while engine.has_unfinished():
        order.extend(o.request_id for o in engine.step() if o.finished)
    return order


def test_priority_orders_the_queue_fifo_within_one(demo_dir) -> None:
    engine = LLMEngine.from_args(
        EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_seqs=1)
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for rid, rank in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5)]:
        engine.add_prompt(rid, _ids(10, ord(rid)), params, priority=rank)
    assert _finish_order(engine) == ["c", "a", "d", "b", "e"]
    assert engine.scheduler._priorities == {}  # every sequence accounted for


def test_a_waiting_request_ages_past_more_urgent_arrivals(demo_dir) -> None:
    """A waiting request's level is its priority minus one per priority_aging_s waited: a
    priority-5 request that has waited 6 periods ranks before a fresh priority-0 one, one that
    has waited 4 after it."""
    import time

    engine = LLMEngine.from_args(
        EngineArgs(
            model=str(demo_dir),
            kv_cache_memory_bytes=16 << 20,
            max_num_seqs=1,
            priority_aging_s=2.0,
        )
    )
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    now = time.monotonic()
    engine.add_prompt("fresh-urgent", _ids(8, 1), params, arrival_time=now, priority=0)
    engine.add_prompt("old", _ids(8, 2), params, arrival_time=now - 13.0, priority=5)
    engine.add_prompt("young", _ids(8, 3), params, arrival_time=now - 9.0, priority=5)
    assert _finish_order(engine) == ["old", "fresh-urgent", "young"]


def test_tenants_take_turns_in_the_waiting_queue(demo_dir) -> None:
    """One tenant's burst queued first does not hold another tenant's request back: within a
    priority level tenants take turns; one tenant alone stays FIFO."""
    from dataclasses import replace

    engine = LLMEngine.from_args(
        EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_seqs=1)
    )
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def add(rid: str, tenant: str, priority: int = 0) -> None:
        inp = engine.input_checker.check(_ids(8, len(rid)), params, priority=priority)
        engine.add_request(rid, replace(inp, tenant=tenant))

    for i in range(4):
        add(f"a{i}", "a")
    add("b0", "b")
    add("b1", "b")
    add("c0", "c", priority=-1)  # more urgent: before every turn of level 0
    assert _finish_order(engine) == ["c0", "a0", "b0", "a1", "b1", "a2", "a3"]
    assert engine.scheduler._tenants == {} and engine.scheduler._priorities == {}


def test_the_least_urgent_running_sequence_is_preempted_first(demo_dir) -> None:
    # 24 blocks of 16 tokens; three sequences that grow to 150 tokens each cannot all stay.
    engine = LLMEngine.from_args(EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=24 * 65536))
    preempted: list[str] = []
    original = engine.scheduler._preempt

    def record(seq, out) -> None:  # noqa: ANN001
        preempted.append(seq.request_id)
        original(seq, out)

    engine.scheduler._preempt = record  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=110, temperature=0.0, ignore_eos=True)
    prompts = {"lazy": _ids(40, 1), "urgent": _ids(40, 2), "normal": _ids(40, 3)}
    ranks = {"lazy": 9, "urgent": 0, "normal": 1}
    for rid, prompt in prompts.items():  # "lazy" is admitted first, yet preempted first
        engine.add_prompt(rid, prompt, params, priority=ranks[rid])
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert preempted and preempted[0] == "lazy", preempted
    assert "urgent" not in preempted
    # Preempted and recomputed, the outputs are those of an ample cache.
    ample = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20)
    assert _run(ample, list(prompts.values()), params) == [got[r] for r in prompts]


def test_priority_must_be_an_integer(demo_dir) -> None:
    import pytest

    llm = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20)
    for bad in (1.5, True, "1", 2**31):
        with pytest.raises(ValueError, match="^priority must be a 32-bit integer"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False, priority=[bad])
    with pytest.raises(ValueError, match="^priority has 2 entries for 1 prompts"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, priority=[0, 1])
