"""`Disaggregation` with real engines standing in for a prefill and a decode replica: a
disaggregated request (prefill capped, then resumed on the other engine) must give exactly
what one engine gives undisturbed: text, tokens, logprobs, finish reason and usage, streamed
or not, greedy or seeded, with stop strings. The policy's decisions, a request that ends on
the prefill, and a failed prefill (the decode engine computes it all, counted) are checked
on the same setup. Ray is not needed: the attempt functions are the handle calls' stand-ins;
the KV tier is not here either, so each decode recomputes the prompt (counted pull_missed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ServeConfig
from cluster.ingress.migration import migrating
from cluster.ingress.pd import HANDOFF_TOKENS, PdPolicy
from cluster.ingress.pd_cost import PdEstimate, ReplicaLoad
from cluster.ingress.pd_metrics import PHASES
from cluster.messages import GenerateRequest
from tests.cluster.ingress.pd_stand_ins import Replicas, collect, make_pd
from workers import AsyncEngine, EngineArgs, SamplingParams
from workers.outputs import RequestOutputKind

PROMPT = list(range(300, 340))
_SEEN: list[list[int]] = []


@pytest.fixture(scope="module")
def engines(demo_dir: Path) -> Iterator[dict[str, AsyncEngine]]:
    made = {
        name: AsyncEngine(EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=32 << 20))
        for name in ("prefill", "decode")
    }
    yield made
    for e in made.values():
        e.shutdown()


def _request(
    engines: dict[str, AsyncEngine], params: SamplingParams, prompt: list[int] = PROMPT
) -> GenerateRequest:
    return GenerateRequest("req", engines["decode"].input_checker.check(prompt, params))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        ),
    ],
    ids=["greedy-logprobs", "seeded", "not-streamed"],
)
def test_a_disaggregated_request_equals_one_engine(
    engines: dict[str, AsyncEngine], params: SamplingParams
) -> None:
    streamed = params.output_kind is RequestOutputKind.DELTA
    # A prompt the decode engine has not cached: it computes it (no KV tier here).
    prompt = [1000 + 3 * len(_SEEN) + i for i in range(40)]
    _SEEN.append(prompt)

    async def both() -> tuple:
        request = _request(engines, params, prompt)
        want = await collect(Replicas(engines).attempt("prefill")(request))
        replicas = Replicas(engines)
        pd, counts = make_pd(engines, replicas)
        got = await collect(migrating(pd.attempt, request, 3))
        return want, got, replicas.seen, counts

    (want_text, want_tokens, want), (text, tokens, got), seen, counts = asyncio.run(both())
    c, w = got.outputs[0], want.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == (w.text, w.token_ids, "length")
    # The same top tokens; values to float32 rounding (the decode computed the handed-off
    # tokens in one chunk, not one per step).
    # The chosen tokens' logprobs (the runner-up of a near tie may differ).
    assert (c.logprobs is None) == (w.logprobs is None)
    for t, got_lp, want_lp in zip(w.token_ids, c.logprobs or [], w.logprobs or [], strict=False):
        assert got_lp[t] == pytest.approx(want_lp[t], abs=1e-4)
    if streamed:  # the deltas add up to the same stream
        assert (text, tokens) == (want_text, want_tokens)
    assert got.metrics.num_generation_tokens == 40
    assert [name for name, _ in seen] == ["prefill", "decode"]
    prefill, decode = seen[0][1], seen[1][1]
    assert prefill.handoff == "prefill" and prefill.input.params.max_tokens == HANDOFF_TOKENS
    assert decode.handoff == "decode"
    assert decode.input.resume[0].output_token_ids == tuple(w.token_ids[:HANDOFF_TOKENS])
    assert counts.decisions == ["disaggregated"] and counts.handoffs == 1
    assert counts.fallbacks == ["pull_missed"]  # no KV tier here: the decode recomputed
    # Its TTFT in phases, streamed (a request that is not has no first decoded token apart).
    if streamed:
        (phases,) = counts.ttfts
        assert list(phases) == list(PHASES) and all(s >= 0 for s in phases.values())
        assert phases["first_decode"] > 0 and phases["prefill"] > 0
    else:
        assert counts.ttfts == []


def test_a_stop_string_held_back_at_the_hand_off_is_cut_as_on_one_engine(
    engines: dict[str, AsyncEngine],
) -> None:
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def run() -> tuple:
        request = _request(engines, base)
        _, _, plain = await collect(Replicas(engines).attempt("decode")(request))
        # A stop string spanning the hand-off: the end of the prefill's tokens' text and the
        # start of the next token's.
        short = SamplingParams(max_tokens=HANDOFF_TOKENS, temperature=0.0, ignore_eos=True)
        _, _, cut = await collect(Replicas(engines).attempt("decode")(_request(engines, short)))
        text, at = plain.outputs[0].text, len(cut.outputs[0].text)
        assert at >= 2, "the first tokens have text"
        stop = text[at - 2 : at + 2]
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
        request = _request(engines, params)
        want = await collect(Replicas(engines).attempt("decode")(request))
        pd, _ = make_pd(engines, Replicas(engines))
        got = await collect(migrating(pd.attempt, request, 3))
        return want, got

    (want_text, _, want), (text, _, got) = asyncio.run(run())
    assert text == want_text and got.outputs[0].text == want.outputs[0].text
    assert got.outputs[0].finish_reason == want.outputs[0].finish_reason


def test_priority_and_tenant_travel_to_both_replicas(engines: dict[str, AsyncEngine]) -> None:
    """The prefill and the decode replica schedule the request as one replica would: with
    its priority and tenant (the adapter too: tests/cluster/test_pd.py, live)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run() -> list[tuple[str, GenerateRequest]]:
        inp = engines["decode"].input_checker.check(list(range(2000, 2040)), params, priority=-3)
        request = GenerateRequest("req", dataclasses.replace(inp, tenant="team-a"))
        replicas = Replicas(engines)
        pd, _ = make_pd(engines, replicas)
        await collect(migrating(pd.attempt, request, 3))
        return replicas.seen

    seen = asyncio.run(run())
    assert [name for name, _ in seen] == ["prefill", "decode"]
    assert [(r.input.priority, r.input.tenant) for _, r in seen] == [(-3, "team-a")] * 2


@pytest.mark.parametrize("at", range(HANDOFF_TOKENS))
def test_a_request_that_ends_on_the_prefill_goes_no_further(
    engines: dict[str, AsyncEngine], at: int
) -> None:
    async def run() -> tuple:
        probe = _request(engines, SamplingParams(max_tokens=5, temperature=0.0))
        _, _, plain = await collect(Replicas(engines).attempt("decode")(probe))
        stop = plain.outputs[0].token_ids[at]  # it stops on its token `at`
        params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop])
        request = _request(engines, params)
        want = await collect(Replicas(engines).attempt("decode")(request))
        replicas = Replicas(engines)
        pd, _ = make_pd(engines, replicas)
        got = await collect(migrating(pd.attempt, request, 3))
        return want, got, replicas.seen

    (want_text, want_tokens, want), (text, tokens, got), seen = asyncio.run(run())
    assert [name for name, _ in seen] == ["prefill"]
    # The streamed deltas add up to the whole output, as on one engine.
    assert (text, tokens) == (want_text, want_tokens)
    assert got.outputs[0].finish_reason == "stop"
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.request_id == "req"


@pytest.mark.parametrize("how", ["dies", "aborts"])
def test_a_failed_prefill_falls_back_to_the_decode_replica(
    engines: dict[str, AsyncEngine], how: str
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def run() -> tuple:
        request = _request(engines, params)
        want = await collect(Replicas(engines).attempt("decode")(request))
        replicas = Replicas(engines, prefill_fails=how)
        pd, counts = make_pd(engines, replicas)
        got = await collect(migrating(pd.attempt, request, 3))
        return want, got, replicas.seen, counts

    (want_text, _, _), (text, _, got), seen, counts = asyncio.run(run())
    assert text == want_text
    assert [name for name, _ in seen] == ["prefill", "decode"]
    assert seen[1][1].handoff is None and not seen[1][1].input.resume  # the whole request
    assert counts.fallbacks == ["prefill_failed"]


def test_a_decode_replica_that_dies_after_the_hand_off_is_a_migration(
    engines: dict[str, AsyncEngine],
) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def run() -> tuple:
        request = _request(engines, params, [2000 + i for i in range(40)])
        want = await collect(Replicas(engines).attempt("decode")(request))
        replicas = Replicas(engines, decode_dies_after=5)
        pd, counts = make_pd(engines, replicas)
        got = await collect(migrating(pd.attempt, request, 3))
        return want, got, replicas.seen, counts

    (want_text, want_tokens, _), (text, tokens, _), seen, counts = asyncio.run(run())
    assert (text, tokens) == (want_text, want_tokens)  # the client saw one exact stream
    assert [name for name, _ in seen] == ["prefill", "decode", "decode"]
    moved = seen[2][1].input
    # It continues from what the client has, on a decode replica (a resumed request is not
    # disaggregated again).
    assert moved.resume and len(moved.resume[0].output_token_ids) > HANDOFF_TOKENS
    assert counts.decisions == ["disaggregated", "resumed"]


@pytest.mark.parametrize(
    ("mode", "prompt_len", "params", "decision"),
    [
        ("always", 8, SamplingParams(max_tokens=10), "disaggregated"),
        ("auto", 8, SamplingParams(max_tokens=10), "short"),
        ("auto", 40, SamplingParams(max_tokens=10), "disaggregated"),
        ("always", 40, SamplingParams(max_tokens=HANDOFF_TOKENS), "no_room"),
        ("always", 40, SamplingParams(max_tokens=10, n=2), "unsupported"),
        ("always", 40, SamplingParams(max_tokens=10, prompt_logprobs=1), "unsupported"),
    ],
)
def test_the_policy_decides_per_request(
    engines: dict[str, AsyncEngine],
    mode: str,
    prompt_len: int,
    params: SamplingParams,
    decision: str,
) -> None:
    checker = engines["decode"].input_checker
    inp = checker.check(PROMPT[:prompt_len], params)
    policy = PdPolicy(mode, step_tokens=32, block_size=16)
    assert policy.decide(inp, checker.max_model_len) == decision
    if decision == "disaggregated":  # no room past the hand-off: local
        assert policy.decide(inp, prompt_len + HANDOFF_TOKENS) == "no_room"


def test_auto_follows_its_estimate_once_it_has_one(engines: dict[str, AsyncEngine]) -> None:
    checker = engines["decode"].input_checker
    long, short = (checker.check(PROMPT[:n], SamplingParams(max_tokens=10)) for n in (40, 8))
    auto, always = (PdPolicy(m, step_tokens=32, block_size=16) for m in ("auto", "always"))
    here, there = PdEstimate(local_s=0.1, pd_s=0.2), PdEstimate(local_s=0.2, pd_s=0.1)
    assert auto.decide(long, 1024, lambda: here) == "cheaper_local"
    assert auto.decide(short, 1024, lambda: there) == "disaggregated"
    assert auto.decide(short, 1024, lambda: None) == "short"  # not known yet: the step rule

    def never() -> PdEstimate:
        raise AssertionError("always needs no estimate")

    assert always.decide(short, 1024, never) == "disaggregated"


def test_prompts_sent_to_prefill_replicas_count_in_their_queue(
    engines: dict[str, AsyncEngine],
) -> None:
    def loads(inp):  # noqa: ANN001, ANN202
        return [ReplicaLoad(running=3)], [ReplicaLoad(), ReplicaLoad()]

    pd, _ = make_pd(engines, Replicas(engines), mode="auto")
    pd._loads = loads
    inp = engines["decode"].input_checker.check(PROMPT, SamplingParams(max_tokens=10))
    idle = pd.estimate(inp)
    pd._prefilling = 4000  # two long prompts in flight to the two prefill replicas
    busy = pd.estimate(inp)
    assert idle is not None and busy is not None
    assert busy.pd_s - idle.pd_s == pytest.approx(2000 / ReplicaLoad().prefill_tokens_per_s)
    assert busy.local_s == idle.local_s


def test_the_policy_follows_the_config() -> None:
    assert PdPolicy.from_config(ServeConfig()) is None  # no prefill replicas
    on = ServeConfig.from_flat(prefill_replicas=1, kv_offload_gib=0.1, kv_share_gib=0.1)
    policy = PdPolicy.from_config(on)
    assert policy is not None and policy.mode == "auto" and policy.step_tokens == 2048
    assert PdPolicy.from_config(on.replace(pd="off")) is None
    with pytest.raises(ValueError, match="prefill_replicas needs kv_share_gib"):
        ServeConfig.from_flat(prefill_replicas=1)
    with pytest.raises(ValueError, match="pd must be one of"):
        ServeConfig.from_flat(pd="sometimes")


def test_a_client_that_leaves_frees_both_replicas(engines: dict[str, AsyncEngine]) -> None:
    """The client goes away while the prefill runs, or mid-decode: neither engine keeps the
    request or a KV block of it."""
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    prompt = [2000 + i % 900 for i in range(1500)]  # a prefill of some milliseconds

    async def leave(after_chunks: int | None, after_s: float = 0.0) -> int:
        pd, _ = make_pd(engines, Replicas(engines))
        chunks = 0

        async def consume() -> None:
            nonlocal chunks
            outs = migrating(pd.attempt, _request(engines, params, prompt), 3)
            async with contextlib.aclosing(outs):
                async for _ in outs:
                    chunks += 1
                    if chunks == after_chunks:
                        return  # leaving: the stream closes

        task = asyncio.create_task(consume())
        if after_chunks is None:  # cancelled while the prefill replica computes
            await asyncio.sleep(after_s)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return chunks

    assert asyncio.run(leave(None, 0.005)) == 0
    _assert_no_blocks_held(engines)
    assert asyncio.run(leave(5)) == 5  # the hand-off's chunk, then 4 of the decode's
    _assert_no_blocks_held(engines)


def _assert_no_blocks_held(engines: dict[str, AsyncEngine]) -> None:
    deadline = time.monotonic() + 10
    while any(e.stats().kv_blocks_used or e.stats().num_requests_running for e in engines.values()):
        assert time.monotonic() < deadline, {n: e.stats() for n, e in engines.items()}
        time.sleep(0.01)
