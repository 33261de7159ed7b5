"""Streams of one OpenAI request's engine outputs (one stream per prompt) -> answers.

An API request with several prompts runs one engine request per prompt; these helpers wait
for the first output of each (so an early error is a status code, not a broken stream),
read a non-streamed answer's final outputs, and interleave streamed ones into SSE frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cluster.errors import KvrayError
from cluster.http.format import SSE_DONE, Formatter, sse
from cluster.ingress.gather import gather_or_cancel


async def first_of_each(streams: Sequence[AsyncIterator[Any]]) -> list[Any]:
    if len(streams) == 1:
        return [await anext(streams[0])]
    return await gather_or_cancel([anext(s) for s in streams])


async def last(stream: AsyncIterator[Any], first: Any) -> Any:
    out = first
    async for out in stream:  # noqa: B007 - only the last (finished) output matters
        pass
    return out


async def close_all(streams: Sequence[Any]) -> None:
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()


async def merge(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[Any]) -> None:
        try:
            async for out in s:
                await queue.put((i, out, None))
            await queue.put((i, done, None))
        except BaseException as err:  # handed to the consumer, which re-raises it
            await queue.put((i, done, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is done:
                live -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def sse_frames(
    fmt: Formatter,
    streams: Sequence[AsyncIterator[Any]],
    firsts: Sequence[Any],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE body of a streamed answer; `firsts` are the outputs first_of_each read."""
    finals = list(firsts)
    try:
        head = "".join(f for i, first in enumerate(firsts) for f in fmt.chunks(first, i))
        if head:
            yield head
        async for i, out in merge(streams):
            finals[i] = out
            frames = fmt.chunks(out, i)
            if frames:
                yield "".join(frames)
        if include_usage:
            yield fmt.usage_chunk(finals)
    except KvrayError as err:  # mid-stream failure: the status line is already sent
        yield sse(err.to_openai())
    finally:
        await close_all(streams)
    yield SSE_DONE
