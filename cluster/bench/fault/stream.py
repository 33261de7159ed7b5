"""Streaming clients of `kvray bench serve --fault-at`: each stream's token arrivals, timed.

The latency bench's backends (common/backends.py) keep gaps between chunks; the fault mode needs
more: the absolute time of every chunk and how many tokens it carried, so that tokens can be
counted before and after the kill and each stream's first token after it found. A stream's
chunk may carry several tokens (the server batches them, --stream-interval-ms), so:

- http: streaming /v1/completions with `logprobs: 0`: every chunk's `logprobs.tokens` lists
  the tokens it carries (the only exact per-chunk count on the OpenAI wire);
- grpc: GenerateStream, whose messages carry their token ids.

A failed stream is a data point: its status (HTTP status, or the `code` of an error frame
sent mid-stream, or the gRPC status name) and message are kept with the tokens it got.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.bench.common.backend_types import BackendContext
from cluster.bench.common.backends import (
    completions_target,
    http_session,
    sse_messages,
    stream_body,
)
from cluster.bench.common.grpc_backend import generate_request, grpc_metadata, open_grpc_stub
from cluster.bench.common.workload import BenchRequest

FAULT_BACKENDS = ("http", "grpc")
CLIENT_ERROR = "client"  # the status of a stream that got no answer from the server


@dataclass
class StreamTrace:
    """One stream, on time.perf_counter's clock."""

    sent: float
    prompt_len: int
    max_tokens: int
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    end: float = 0.0
    ok: bool = False
    status: str = ""  # "200", "503", "UNAVAILABLE", ... or CLIENT_ERROR
    error: str = ""
    output_len: int = 0  # usage.completion_tokens (ok streams)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class StreamClient(Protocol):
    async def send(self, req: BenchRequest) -> StreamTrace: ...

    async def close(self) -> None: ...


async def open_stream_client(name: str, ctx: BackendContext) -> StreamClient:
    if name == "http":
        return await HttpStreams.open(ctx)
    if name == "grpc":
        return await GrpcStreams.open(ctx)
    raise ValueError(f"--fault-at runs over {' or '.join(FAULT_BACKENDS)}, not {name!r}")


class HttpStreams:
    def __init__(self, ctx: BackendContext, session: Any) -> None:
        self._ctx = ctx
        self._session = session
        self._url, self._headers = completions_target(ctx)

    @staticmethod
    async def open(ctx: BackendContext) -> HttpStreams:
        return HttpStreams(ctx, http_session(ctx))

    async def send(self, req: BenchRequest) -> StreamTrace:
        body = {**stream_body(self._ctx, req), "logprobs": 0}  # each chunk lists its tokens
        trace = StreamTrace(time.perf_counter(), req.prompt_len, req.output_len)
        try:
            async with self._session.post(self._url, json=body, headers=self._headers) as resp:
                trace.status = str(resp.status)
                if resp.status != 200:
                    trace.error = (await resp.text())[:200]
                    return _ended(trace)
                async for now, msg in sse_messages(resp):
                    if not _http_frame(trace, now, msg):
                        return _ended(trace)
        except Exception as err:  # a failed stream is a data point, not a crash
            trace.status, trace.error = CLIENT_ERROR, f"{type(err).__name__}: {err}"
            return _ended(trace)
        return _finished(trace)

    async def close(self) -> None:
        await self._session.close()


def _http_frame(trace: StreamTrace, now: float, msg: dict[str, Any]) -> bool:
    """Records one SSE frame that arrived at `now`; False when it is an error (the stream ends
    there)."""
    err = msg.get("error")
    if err:
        trace.status = str(err.get("code") or "error")
        trace.error = str(err.get("message"))[:200]
        return False
    tokens = 0
    for choice in msg.get("choices") or ():
        tokens += len((choice.get("logprobs") or {}).get("tokens") or ())
    if tokens:
        trace.chunks.append((now, tokens))
    usage = msg.get("usage")
    if usage:
        trace.output_len = int(usage["completion_tokens"])
    return True


class GrpcStreams:
    def __init__(self, ctx: BackendContext, channel: Any, stub: Any) -> None:
        self._ctx = ctx
        self._channel = channel
        self._stub = stub
        self._metadata = grpc_metadata(ctx)

    @staticmethod
    async def open(ctx: BackendContext) -> GrpcStreams:
        return GrpcStreams(ctx, *await open_grpc_stub(ctx))

    async def send(self, req: BenchRequest) -> StreamTrace:
        import grpc

        msg = generate_request(self._ctx, req)
        trace = StreamTrace(time.perf_counter(), req.prompt_len, req.output_len)
        try:
            async for resp in self._stub.GenerateStream(msg, metadata=self._metadata):
                tokens = sum(len(c.token_ids) for c in resp.completions)
                if tokens:
                    trace.chunks.append((time.perf_counter(), tokens))
                if resp.HasField("usage"):
                    trace.output_len = resp.usage.completion_tokens
        except grpc.aio.AioRpcError as err:
            trace.status, trace.error = err.code().name, str(err.details())[:200]
            return _ended(trace)
        except Exception as err:  # noqa: BLE001 - a failed stream is a data point
            trace.status, trace.error = CLIENT_ERROR, f"{type(err).__name__}: {err}"
            return _ended(trace)
        trace.status = "OK"
        return _finished(trace)

    async def close(self) -> None:
        await self._channel.close()


def _ended(trace: StreamTrace) -> StreamTrace:
    trace.end = time.perf_counter()
    return trace


def _finished(trace: StreamTrace) -> StreamTrace:
    """A stream that ended without an error: ok when its usage came and counts all tokens."""
    trace.end = time.perf_counter()
    trace.ok = trace.output_len > 0
    if not trace.ok:
        trace.status, trace.error = CLIENT_ERROR, "no usage in the stream"
    return trace
