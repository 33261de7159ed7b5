"""`kvray bench pd`'s set-ups, summary and cross-set-up check (the runs themselves need a
Ray cluster and minutes: docs/benchmarks.md has one)."""

from __future__ import annotations

import argparse
import math

import pytest

from cluster.bench.pd.main import _config, _mismatches, add_arguments, summarize
from cluster.bench.pd.trace import Record, TraceShape, prompt


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def test_every_setup_has_the_same_replicas_and_chunking() -> None:
    args = _args("--replicas", "3", "--max-num-batched-tokens", "256")
    colocated, always, auto = (_config(s, args, "/m") for s in ("colocated", "always", "auto"))
    assert colocated.replicas.num_replicas == 3 and colocated.pd.prefill_replicas == 0
    for c, mode in ((always, "always"), (auto, "auto")):
        assert (c.replicas.num_replicas, c.pd.prefill_replicas, c.pd.pd) == (2, 1, mode)
    for c in (colocated, always, auto):
        assert c.engine.max_num_batched_tokens == 256 and c.replicas.stream_interval_ms == 0


def _rec(key: str, kind: str, ttft: float, gaps: list[float], tokens: int) -> Record:
    return Record(key, kind, ttft, gaps, ttft + sum(gaps), tokens, "x")


def test_summary_goodput_counts_requests_within_both_slos() -> None:
    args = _args("--ttft-slo-ms", "500", "--tpot-slo-ms", "50")
    shape = TraceShape(1, 8, 4, 64, 2, 1, 1.0, 10.0, 0)
    quiet = [_rec("q:s0-0", "steady", 0.1, [0.01, 0.01, 0.01], 4)]
    bursty = [
        _rec("b:s0-0", "steady", 0.1, [0.01, 0.02, 0.01], 4),  # good
        _rec("b:s0-1", "steady", 0.9, [0.01, 0.01, 0.01], 4),  # TTFT over its SLO
        _rec("b:b1-0", "burst", 0.2, [0.2], 2),  # 200 ms per output token: over
    ]
    s = summarize(quiet, bursty, shape, args)
    assert s["good"] == 1 and s["requests"] == 3
    assert s["goodput_per_s"] == pytest.approx(0.1)
    assert s["gap_p99_bursty_over_quiet"] == pytest.approx(2.0)
    assert s["burst_ttft_ms"]["p50"] == pytest.approx(200.0)
    empty = summarize([], [], shape, args)  # a mix without streams: no gaps, no crash
    assert math.isnan(empty["quiet_gap_ms"]["p99"]) and empty["requests"] == 0


def test_outputs_that_differ_across_setups_are_named() -> None:
    same = {"a": {"k1": "x", "k2": "y"}, "b": {"k1": "x", "k2": "y", "k3": "z"}}
    assert _mismatches(same) == []
    assert _mismatches({"a": {"k1": "x"}, "b": {"k1": "w"}}) == ["k1: a 'x', b 'w'"]


def test_a_key_gets_the_same_prompt_in_every_run() -> None:
    shape = TraceShape(1, 8, 4, 64, 2, 1, 1.0, 10.0, 7)
    ids = list(range(100, 200))
    assert prompt(shape, ids, "q:s0-1", 8) == prompt(shape, ids, "q:s0-1", 8)
    assert prompt(shape, ids, "q:s0-1", 8) != prompt(shape, ids, "q:s0-2", 8)
