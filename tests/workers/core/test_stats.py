"""EngineStats' compile-time window: a reader takes each compile once, without popping."""

from __future__ import annotations

from workers.core.stats import RECENT_COMPILES, EngineStats, new_compile_seconds


def _stats(count: int) -> EngineStats:
    recent = tuple(float(i) for i in range(max(0, count - RECENT_COMPILES) + 1, count + 1))
    return EngineStats(grammar_compiles=count, recent_grammar_compile_seconds=recent)


def test_new_compiles_are_taken_once() -> None:
    assert new_compile_seconds(_stats(0), 0) == []
    assert new_compile_seconds(_stats(3), 0) == [1.0, 2.0, 3.0]
    assert new_compile_seconds(_stats(5), 3) == [4.0, 5.0]
    assert new_compile_seconds(_stats(5), 5) == []


def test_a_reader_far_behind_gets_the_window_and_a_rebuilt_engine_starts_over() -> None:
    far = new_compile_seconds(_stats(RECENT_COMPILES + 10), 0)
    assert len(far) == RECENT_COMPILES and far[-1] == RECENT_COMPILES + 10
    assert new_compile_seconds(_stats(2), 7) == [1.0, 2.0]  # counts went down: a new engine


def test_waiting_prefill_tokens_follow_the_chunked_prefill(demo_dir) -> None:
    """Every waiting token counts; a running prompt counts what it has not prefilled yet."""
    from workers import SamplingParams
    from workers.config import EngineArgs
    from workers.core.engine import LLMEngine

    args = EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=64)
    engine = LLMEngine.from_args(args)
    params = SamplingParams(max_tokens=2, n=2, temperature=1.0, ignore_eos=True)
    engine.add_prompt("long", list(range(5, 205)), params)  # 200 tokens, two samples
    engine.add_prompt("short", list(range(5, 15)), SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.stats().num_waiting_prefill_tokens == 2 * 200 + 10
    seen = [engine.stats().num_waiting_prefill_tokens]
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.stats().num_waiting_prefill_tokens)
    assert seen[-1] == 0
    assert seen == sorted(seen, reverse=True)  # the 64-token budget drains it step by step
    assert seen[1] < seen[0] and len(seen) > 4
