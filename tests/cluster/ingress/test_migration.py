"""`migrating` with real engines standing in for two replicas: the first attempt's engine
"dies" (its attempt raises EngineDeadError naming replica "a") after a few outputs, the next
attempt runs on the other engine; what the caller gets must equal an undisturbed run. The
policy (max_migrations, the replica to avoid, the error when exhausted) is checked on the
same setup. Ray is not needed: the attempt function is the handle call's stand-in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cluster.errors import EngineDeadError, QueueFullError
from cluster.ingress.migration import migrating
from cluster.messages import GenerateRequest
from workers import AsyncEngine, EngineArgs, SamplingParams
from workers.outputs import RequestOutput, RequestOutputKind


@pytest.fixture(scope="module")
def engines(demo_dir: Path) -> Iterator[dict[str, AsyncEngine]]:
    made = {
        name: AsyncEngine(EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=32 << 20))
        for name in ("a", "b")
    }
    yield made
    for e in made.values():
        e.shutdown()


class Replicas:
    """Attempts go to replica "a" until it fails, then to the first one not excluded."""

    def __init__(self, engines: dict[str, AsyncEngine], fail_after: int, failures: int = 1):
        self.engines = engines
        self.fail_after = fail_after  # outputs an attempt yields before its replica dies
        self.failures = failures  # attempts that fail so
        self.seen: list[GenerateRequest] = []
        self._ids = itertools.count()

    async def attempt(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.seen.append(request)
        # The routers pass over excluded replicas while another lives, else pick one anyway.
        names = list(self.engines)
        name = next((n for n in names if n not in request.exclude_replicas), names[-1])
        failing = len(self.seen) <= self.failures
        engine = self.engines[name]
        rid = f"{request.request_id}.{next(self._ids)}"
        count = 0
        async for out in engine.generate_input(request.input, rid):
            if failing and count == self.fail_after:
                engine.abort(rid)  # what the engine's death does to its KV blocks
                raise EngineDeadError("engine died: test", replica=name)
            count += 1
            yield out


def _request(engines: dict[str, AsyncEngine], params: SamplingParams) -> GenerateRequest:
    checker = engines["a"].input_checker
    return GenerateRequest("req", checker.check(list(range(300, 324)), params))


async def _collect(outs: AsyncIterator[RequestOutput]) -> tuple[dict[int, str], RequestOutput]:
    texts: dict[int, str] = {}
    last = None
    async for out in outs:
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.delta_text
        last = out
    assert last is not None and last.finished
    return texts, last


def _run(coro):  # noqa: ANN001, ANN202
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=80, temperature=0.9, top_p=0.9, seed=7, n=3, ignore_eos=True),
        SamplingParams(
            max_tokens=80,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        ),
    ],
    ids=["greedy", "seeded-n3", "not-streamed"],
)
def test_a_request_moved_mid_stream_equals_an_undisturbed_run(
    engines: dict[str, AsyncEngine], params: SamplingParams
) -> None:
    streamed = params.output_kind is RequestOutputKind.DELTA

    async def both() -> tuple:
        request = _request(engines, params)
        undisturbed = Replicas(engines, fail_after=10**9, failures=0)
        want = await _collect(migrating(undisturbed.attempt, request, 3))
        # Not streamed: its one output is the last, so the engine dies before it.
        moved = Replicas(engines, fail_after=5 if streamed else 0)
        got = await _collect(migrating(moved.attempt, request, 3))
        return want, got, moved.seen

    (want_texts, want), (got_texts, got), seen = _run(both())
    assert got_texts == want_texts
    assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert [c.finish_reason for c in got.outputs] == ["length"] * params.n
    assert got.metrics.num_generation_tokens == want.metrics.num_generation_tokens == 80 * params.n
    # The second attempt avoided the replica that failed, under a new engine request id.
    assert [r.migration for r in seen] == [0, 1]
    assert seen[1].exclude_replicas == {"a"} and seen[1].request_id != seen[0].request_id
    assert bool(seen[1].input.resume) == streamed  # not streamed: it runs again from scratch
    _assert_no_blocks_held(engines)


def _assert_no_blocks_held(engines: dict[str, AsyncEngine]) -> None:
    """Every KV block came back (stats refresh once the engine thread ran the abort)."""
    deadline = time.monotonic() + 10
    while any(e.stats().kv_blocks_used for e in engines.values()):
        assert time.monotonic() < deadline, {n: e.stats() for n, e in engines.items()}
        time.sleep(0.01)


def test_more_failures_than_max_migrations_is_an_error_naming_the_limit(
    engines: dict[str, AsyncEngine],
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    failing = Replicas(engines, fail_after=3, failures=10)

    async def run() -> None:
        await _collect(migrating(failing.attempt, _request(engines, params), 1))

    with pytest.raises(EngineDeadError, match=r"failed on 2 replicas \(max_migrations=1\)"):
        _run(run())
    assert len(failing.seen) == 2


def test_max_migrations_zero_keeps_the_original_error(engines: dict[str, AsyncEngine]) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    failing = Replicas(engines, fail_after=3)

    async def run() -> None:
        await _collect(migrating(failing.attempt, _request(engines, params), 0))

    with pytest.raises(EngineDeadError, match="engine died: test"):
        _run(run())
    assert len(failing.seen) == 1


def test_a_moved_stream_gets_its_prompt_logprobs_once(engines: dict[str, AsyncEngine]) -> None:
    """The resumed attempt scores the prompt again; the client already has that."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    async def run() -> list[RequestOutput]:
        moved = Replicas(engines, fail_after=5)
        # Its own request id: an earlier test's abort of "req.0" may still be on its way.
        request = dataclasses.replace(_request(engines, params), request_id="scored")
        return [o async for o in migrating(moved.attempt, request, 3)]

    outs = _run(run())
    scored = [o.prompt_logprobs for o in outs if not o.finished and o.prompt_logprobs]
    assert len(scored) == 1 and len(scored[0]) == 24 and scored[0][0] is None
    final = outs[-1].prompt_logprobs
    assert outs[-1].finished and final is not None and final[0] is None
    # The final output's are the resumed attempt's: the same up to float rounding (its
    # prefill spans prompt + outputs, batched differently).
    for got, first in zip(final[1:], scored[0][1:], strict=True):
        assert got.keys() == first.keys()
        assert all(abs(got[t] - first[t]) < 1e-4 for t in got)
    _assert_no_blocks_held(engines)


class Refusing(Replicas):
    """Like Replicas, but the first `refusals` attempts after the first failure are turned
    away untaken (the replica's engine is dead or restarting), naming replica "b"."""

    def __init__(self, engines: dict[str, AsyncEngine], fail_after: int, refusals: int):
        super().__init__(engines, fail_after)
        self.refusals = refusals

    async def attempt(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if len(self.seen) >= 1 and self.refusals:
            self.refusals -= 1
            self.seen.append(request)
            raise EngineDeadError("engine is restarting", replica="b", taken=False)
        async for out in super().attempt(request):
            yield out


def test_refusals_before_anything_ran_wait_uncharged(engines: dict[str, AsyncEngine]) -> None:
    """Two faults close together: the replica a stream ran on dies (one migration), and the
    other one is restarting its engine for a while (refusing, untaken). The stream waits for
    it instead of spending migrations, and finishes as if undisturbed."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def both() -> tuple:
        request = _request(engines, params)
        want = await _collect(migrating(Replicas(engines, 10**9, 0).attempt, request, 1))
        refusing = Refusing(engines, fail_after=5, refusals=6)
        got = await _collect(migrating(refusing.attempt, request, 1, None, 30.0))
        return want, got, refusing.seen

    (want_texts, _), (got_texts, got), seen = _run(both())
    assert got_texts == want_texts and got.outputs[0].finish_reason == "length"
    assert len(seen) == 8  # the first attempt, 6 refusals, the attempt that finished
    assert [r.migration for r in seen] == [0] + [1] * 7  # only the real failure was charged
    assert seen[-1].exclude_replicas == {"a", "b"}
    _assert_no_blocks_held(engines)


def test_no_replica_taking_it_within_the_queue_timeout_is_a_503(
    engines: dict[str, AsyncEngine],
) -> None:
    from cluster.errors import QueueTimeoutError

    async def never() -> None:
        refusing = Refusing(engines, fail_after=0, refusals=10**9)
        refusing.seen.append(None)  # every attempt is refused
        request = _request(engines, SamplingParams(max_tokens=4))
        await _collect(migrating(refusing.attempt, request, 3, None, 0.5))

    t0 = time.monotonic()
    with pytest.raises(QueueTimeoutError, match=r"within queue_timeout_s \(0.5 s\)") as err:
        _run(never())
    assert err.value.http_status == 503 and err.value.retry_after_s >= 1
    assert 0.5 <= time.monotonic() - t0 < 5


class Full(Replicas):
    """Replicas whose waiting queues are at their cap (`full`) refuse with QueueFullError
    naming themselves, before anything ran; the others serve."""

    def __init__(self, engines: dict[str, AsyncEngine], full: set[str]):
        super().__init__(engines, fail_after=10**9, failures=0)
        self.full = full

    async def attempt(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        names = list(self.engines)
        name = next((n for n in names if n not in request.exclude_replicas), names[-1])
        if name in self.full:
            self.seen.append(request)
            raise QueueFullError("too many requests waiting on this replica", replica=name)
        async for out in super().attempt(request):
            yield out


def test_a_full_replica_s_refusal_goes_to_another_uncharged(
    engines: dict[str, AsyncEngine],
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    request = _request(engines, params)
    room_on_b = Full(engines, full={"a"})
    _, last = _run(_collect(migrating(room_on_b.attempt, request, 3)))
    assert last.outputs[0].finish_reason == "length"
    assert [r.exclude_replicas for r in room_on_b.seen] == [set(), {"a"}]
    assert [r.migration for r in room_on_b.seen] == [0, 0]  # no migration charged

    # Every replica full: each is tried once, then the 429 is the client's.
    all_full = Full(engines, full={"a", "b"})
    with pytest.raises(QueueFullError, match="too many requests waiting"):
        _run(_collect(migrating(all_full.attempt, request, 3)))
    assert [r.exclude_replicas for r in all_full.seen] == [set(), {"a"}, {"a", "b"}]

    # Serve's own queue cap names no replica: nothing to try instead.
    class ServeFull(Replicas):
        async def attempt(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
            self.seen.append(request)
            raise QueueFullError("too many requests queued for the engine replicas")
            yield  # an async generator, as the handle call is

    serve_full = ServeFull(engines, fail_after=0)
    with pytest.raises(QueueFullError, match="queued for the engine replicas"):
        _run(_collect(migrating(serve_full.attempt, request, 3)))
    assert len(serve_full.seen) == 1
    _assert_no_blocks_held(engines)
