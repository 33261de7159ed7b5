"""Shared checks for engine failures: streams that a failure must end, and a dead engine that
must stay dead (every later call an EngineDeadError, never a hang)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from workers import AsyncEngine, SamplingParams
from workers.errors import EngineDeadError


def fail_while_streaming(
    eng: AsyncEngine,
    params: SamplingParams,
    fail: Callable[[], None],
    streams: int = 8,
    after_tokens: int = 16,
) -> list[object]:
    """Starts `streams` requests, calls `fail()` once `after_tokens` were generated, and returns
    each request's result (its token count, or the exception that ended it)."""

    async def one(i: int) -> int:
        n = 0
        async for out in eng.generate(f"request {i}", params, f"k{i}"):
            n += len(out.outputs[0].delta_token_ids)
        return n

    async def main() -> list[object]:
        tasks = [asyncio.create_task(one(i)) for i in range(streams)]
        while eng.stats().generation_tokens < after_tokens:  # streaming for real
            await asyncio.sleep(0.01)
        fail()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)

    return asyncio.run(main())


def assert_dead_for_good(
    eng: AsyncEngine, params: SamplingParams, match: str | None = None
) -> None:
    assert not eng.healthy
    with pytest.raises(EngineDeadError, match=match):
        eng.check_health()

    async def later() -> None:
        async for _ in eng.generate("x", params, "late"):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(later(), timeout=10))
