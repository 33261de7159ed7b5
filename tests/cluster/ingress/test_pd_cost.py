"""auto's estimate (cluster/ingress/pd_cost.py): each way's added delay, from replicas'
load, cached prefixes and measured rates, in the situations the choice is for."""

from __future__ import annotations

import pytest

from cluster.ingress.pd_cost import PdEstimate, ReplicaLoad, estimate

BS = 16
RATE = 2000.0  # prompt tokens per second
STEP_S = 0.01
# A demo-sized KV: 2 layers x (K, V) x 4 heads x 32 dims x 4 bytes.
BYTES_PER_TOKEN = 2 * 2 * 4 * 32 * 4


def _replica(**kw: object) -> ReplicaLoad:
    base = {
        "prefill_tokens_per_s": RATE,
        "step_s": STEP_S,
        "pull_bytes_per_s": 1e9,
        "pull_overhead_s": 0.002,
        "kv_bytes_per_token": BYTES_PER_TOKEN,
    }
    return ReplicaLoad(**{**base, **kw})  # type: ignore[arg-type]


def _est(prompt: int, decode: list[ReplicaLoad], prefill: list[ReplicaLoad]) -> PdEstimate:
    est = estimate(prompt, decode, prefill, block_size=BS, handoff_tokens=2)
    assert est is not None
    return est


def test_a_short_prompt_on_an_idle_decode_replica_stays_local() -> None:
    est = _est(64, [_replica()], [_replica()])
    assert not est.disaggregate
    # The hand-off costs two prefill steps and a decode step more than one step here.
    assert est.pd_s - est.local_s == pytest.approx(2 * STEP_S, rel=0.2)


def test_a_long_prompt_beside_running_streams_moves() -> None:
    est = _est(1024, [_replica(running=3)], [_replica()])
    assert est.disaggregate
    # Locally the three streams wait for the whole prompt too.
    assert est.local_s == pytest.approx(STEP_S + 4 * 1024 / RATE)


def test_a_long_prompt_on_an_idle_decode_replica_stays_local() -> None:
    assert not _est(1024, [_replica()], [_replica()]).disaggregate


def test_a_short_prompt_moves_when_the_decode_replica_is_busy_and_a_prefill_one_idle() -> None:
    assert _est(64, [_replica(running=6, waiting=2)], [_replica()]).disaggregate


def test_a_prompt_mostly_cached_on_the_decode_replica_stays_local() -> None:
    decode = [_replica(running=3, cached_tokens=1008)]
    assert not _est(1024, decode, [_replica()]).disaggregate
    # Not cached, the same load moves it.
    assert _est(1024, [_replica(running=3)], [_replica()]).disaggregate


def test_a_deep_prefill_queue_keeps_a_prompt_local() -> None:
    decode = [_replica(running=1)]
    assert _est(1024, decode, [_replica()]).disaggregate
    assert not _est(1024, decode, [_replica(queued_tokens=8192, waiting=8)]).disaggregate


def test_each_side_takes_its_best_replica() -> None:
    busy, idle = _replica(running=3), _replica()
    # One idle decode replica: the long prompt can stay local there.
    assert not _est(1024, [busy, idle], [_replica()]).disaggregate
    # One of two prefill replicas idle: it goes there.
    queued = _replica(queued_tokens=8192, waiting=8)
    assert _est(1024, [busy], [queued, _replica()]).disaggregate


def test_what_a_peer_holds_is_pulled_not_computed() -> None:
    # The decode replica pulls the prompt from a peer in a few ms: cheaper than moving it.
    decode = [_replica(running=3, pullable_tokens=1008)]
    assert not _est(1024, decode, [_replica()]).disaggregate
    # A slow pull (a tenth of the prefill's rate, in bytes) makes computing it elsewhere pay.
    slow = RATE * BYTES_PER_TOKEN / 10
    decode = [_replica(running=3, pullable_tokens=1008, pull_bytes_per_s=slow)]
    assert _est(1024, decode, [_replica()]).disaggregate


def test_no_replica_on_a_side_gives_no_estimate() -> None:
    assert estimate(64, [], [_replica()], block_size=BS, handoff_tokens=2) is None
    assert estimate(64, [_replica()], [], block_size=BS, handoff_tokens=2) is None
