"""Adaptive coalescing of streamed outputs: merged deltas add up, nothing lost, early exit
closes the source (merge_outputs itself: tests/workers/test_outputs.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cluster.coalesce import coalesced
from tests.workers.test_outputs import step_output as _out
from workers.outputs import RequestOutput


async def _source(
    total: int, closed: list[bool], delay: float = 0.0
) -> AsyncIterator[RequestOutput]:
    try:
        for step in range(total):
            if delay:
                await asyncio.sleep(delay)
            yield _out(step, total)
    finally:
        closed.append(True)


def test_a_slow_consumer_gets_fewer_chunks_with_the_same_text() -> None:
    async def run() -> tuple[int, str]:
        chunks, text = 0, ""
        async for out in coalesced(_source(50, [])):
            chunks += 1
            text += out.outputs[0].delta_text
            await asyncio.sleep(0.01)  # a consumer slower than its source
        return chunks, text

    chunks, text = asyncio.run(run())
    assert text == "".join(f"t{k}" for k in range(50))
    assert chunks < 50


def test_interval_merges_and_the_last_output_still_arrives() -> None:
    async def run() -> list[RequestOutput]:
        return [o async for o in coalesced(_source(20, [], delay=0.001), interval_s=0.05)]

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs) < 20
    assert sum(len(o.outputs[1].delta_token_ids) for o in outs) == 20


def test_an_interval_function_is_read_before_each_wait() -> None:
    """A floor that follows the load: 0 while chunks go one token each, then 50 ms."""
    yielded: list[int] = []

    def interval() -> float:
        return 0.0 if len(yielded) < 10 else 0.05

    async def run() -> list[RequestOutput]:
        outs = []
        async for o in coalesced(_source(60, [], delay=0.002), interval_s=interval):
            outs.append(o)
            yielded.append(len(o.outputs[0].delta_token_ids))
            await asyncio.sleep(0.003)  # slower than the source: every chunk is due at once
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished
    assert sum(yielded) == 60
    assert len(outs) < 30 and max(yielded[10:]) > max(yielded[:10])


def test_leaving_early_closes_the_source() -> None:
    closed: list[bool] = []

    async def run() -> None:
        stream = coalesced(_source(1000, closed, delay=0.001))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(run())
    assert closed == [True]
