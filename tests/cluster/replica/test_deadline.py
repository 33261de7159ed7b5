"""with_deadline ends a stream with RequestTimeoutError at its deadline, even while the
stream is stuck between items, and closes the inner stream (how the engine request is
aborted); a stream that ends in time passes through untouched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cluster.errors import RequestTimeoutError
from cluster.replica.deadline import with_deadline


class _Source:
    def __init__(self, gaps: list[float]) -> None:
        self.gaps = gaps
        self.closed = False

    async def stream(self) -> AsyncIterator[int]:
        try:
            for i, gap in enumerate(self.gaps):
                await asyncio.sleep(gap)
                yield i
        finally:
            self.closed = True


async def _collect(stream: AsyncIterator[int]) -> list[int]:
    return [x async for x in stream]


def test_a_stream_that_ends_in_time_is_untouched() -> None:
    src = _Source([0.0, 0.01, 0.0])
    assert asyncio.run(_collect(with_deadline(src.stream(), 5.0))) == [0, 1, 2]
    assert src.closed


def test_a_stuck_stream_ends_at_the_deadline_and_is_closed() -> None:
    src = _Source([0.0, 0.0, 3600.0])  # the third item would take an hour
    got: list[int] = []

    async def main() -> None:
        async for x in with_deadline(src.stream(), 0.2):
            got.append(x)

    with pytest.raises(RequestTimeoutError, match="request_timeout_s") as err:
        asyncio.run(asyncio.wait_for(main(), 30))
    assert got == [0, 1]
    assert src.closed  # the inner stream was closed: its engine request is aborted
    assert err.value.http_status == 504 and err.value.grpc_code == "DEADLINE_EXCEEDED"
