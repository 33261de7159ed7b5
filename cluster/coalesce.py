"""Adaptive coalescing of streamed RequestOutputs: merge whatever piled up, never wait.

Every streamed output costs a message at each hop (replica -> ingress -> proxy -> client),
and on a busy machine those hops fall behind the engine. `coalesced(stream)` reads the stream
in a background task and hands the consumer everything that arrived since it last asked,
merged into one RequestOutput (`workers.outputs.merge_outputs`: the latest state, deltas
concatenated). An idle consumer gets each output as soon as it exists, so latency is
unchanged; a lagging one gets fewer, larger messages instead of a growing backlog.

Serve ships a replica's yields without ever blocking the generator, so on its own the merging
above rarely kicks in there; `interval_s` adds a floor between two yields (the first output
and the finished one always go at once). Like vLLM's and SGLang's stream interval, it trades
chunk granularity for far fewer messages per generated token. It may be a function, read
before each wait, so the floor can follow the load (see `cluster.replica.llm_server`).
The ingresses' side (`cluster.ingress.llm_client`) merges only what their consumer lags by.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from workers.outputs import RequestOutput, merge_outputs


async def coalesced(
    stream: AsyncIterator[RequestOutput], interval_s: float | Callable[[], float] = 0.0
) -> AsyncIterator[RequestOutput]:
    """`stream`, with outputs that arrive while the consumer is busy (or within `interval_s`
    of the previous yield) merged into one."""
    loop = asyncio.get_running_loop()
    interval = interval_s if callable(interval_s) else lambda: interval_s
    pending: list[RequestOutput] = []
    ready = asyncio.Event()
    last = asyncio.Event()  # the finished output (or the end) is in `pending`
    failure: list[BaseException] = []

    async def pump() -> None:
        try:
            async for out in stream:
                pending.append(out)
                ready.set()
                if out.finished:
                    last.set()
        except BaseException as err:  # handed to the consumer below
            failure.append(err)
        finally:
            last.set()
            ready.set()

    task = loop.create_task(pump())
    last_yield = -float("inf")
    try:
        while True:
            await ready.wait()
            wait = last_yield + interval() - loop.time()
            if wait > 0 and not last.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(last.wait(), wait)
            ready.clear()
            if pending:
                batch = pending[:]
                pending.clear()
                last_yield = loop.time()
                yield merge_outputs(batch)
            if last.is_set() and task.done() and not pending:
                if failure and not isinstance(failure[0], asyncio.CancelledError):
                    raise failure[0]
                return
    finally:
        if not task.done():
            # The consumer left early: stop reading, which closes (and aborts) the source.
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
