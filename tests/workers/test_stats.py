"""EngineStats' compile-time window: a reader takes each compile once, without popping."""

from __future__ import annotations

from workers.stats import RECENT_COMPILES, EngineStats, new_compile_seconds


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
