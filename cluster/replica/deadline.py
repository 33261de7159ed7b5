"""with_deadline: a stream that ends with RequestTimeoutError once it has run too long.

Each wait for the next item is bounded by what is left of the deadline, so a stream whose
engine is slow (or stuck between outputs) is closed at the deadline, not at its next output.
Closing the inner stream is how the engine request is aborted (LLMServer's clean-up).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from cluster.errors import RequestTimeoutError

T = TypeVar("T")


async def with_deadline(stream: AsyncIterator[T], timeout_s: float) -> AsyncIterator[T]:
    """`stream`'s items until `timeout_s` seconds from the first read, then the error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            # A timed-out wait cancels the inner read; the inner generator is then closed.
            async with asyncio.timeout_at(deadline):
                item = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request ran longer than request_timeout_s ({timeout_s:g} s) and was aborted"
            ) from None
        yield item
