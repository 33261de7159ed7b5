"""gather_or_cancel: every result in order, or the first failure with the rest cancelled."""

from __future__ import annotations

import asyncio

import pytest

from cluster.ingress.gather import gather_or_cancel


def test_results_in_order_and_a_failure_cancels_the_rest() -> None:
    cancelled: list[str] = []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise
        return name

    async def fails() -> str:
        await asyncio.sleep(0.01)
        raise ValueError("boom")

    async def main() -> None:
        assert await gather_or_cancel([asyncio.sleep(0.02, "a"), asyncio.sleep(0, "b")]) == [
            "a",
            "b",
        ]
        with pytest.raises(ValueError, match="boom"):
            await gather_or_cancel([slow("x"), fails(), slow("y")])

    asyncio.run(main())
    assert sorted(cancelled) == ["x", "y"]  # cancelled and awaited before the error left
