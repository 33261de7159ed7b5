"""Running several engine requests of one client request at once (a batch of prompts, n
inputs to embed): all their results, or the first failure with the others cancelled (which
aborts their engine requests, so no KV block stays held for an answer nobody will read)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

T = TypeVar("T")


async def gather_or_cancel(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, in order; on the first failure the others are cancelled and awaited
    (so their generators are idle and can be closed), then the failure is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
