"""The `grpc` backend of `kvray bench serve`: the HTTP backend's request, over GenerateStream.

Same work as the http backend (token-id prompt, greedy, ignore_eos, max_tokens = output
length; one message per engine step) so the two report comparable figures: TTFT is the
first message carrying tokens, ITL the gaps between later ones, output and cached token
counts come from the last message's usage. One channel (one HTTP/2 connection) carries every
concurrent stream, as a service's client would.
"""

from __future__ import annotations

import time
from typing import Any

from cluster.bench.common.backend_types import BackendContext, RequestRecord
from cluster.bench.common.workload import BenchRequest


async def open_grpc_backend(ctx: BackendContext) -> GrpcBackend:
    return GrpcBackend(ctx, *await open_grpc_stub(ctx))


async def open_grpc_stub(ctx: BackendContext) -> tuple[Any, Any]:
    """(channel, LLMService stub) to --grpc-address, once the channel is ready."""
    import grpc.aio

    from kvray.v1 import llm_pb2_grpc

    if not ctx.grpc_address:
        raise ValueError("the grpc backend needs --grpc-address HOST:PORT (or --launch)")
    channel = grpc.aio.insecure_channel(ctx.grpc_address)
    await channel.channel_ready()
    return channel, llm_pb2_grpc.LLMServiceStub(channel)


def grpc_metadata(ctx: BackendContext) -> tuple[tuple[str, str], ...]:
    """Call metadata: the API key, if any."""
    return (("authorization", f"Bearer {ctx.api_key}"),) if ctx.api_key else ()


def generate_request(ctx: BackendContext, req: BenchRequest) -> Any:
    """The GenerateRequest of a bench request: greedy, ignore_eos unless constrained."""
    from kvray.v1 import llm_pb2

    msg = llm_pb2.GenerateRequest(
        model=req.model or ctx.model,
        token_ids=llm_pb2.TokenIds(ids=req.prompt_ids),
        sampling=llm_pb2.SamplingParams(
            max_tokens=req.output_len, ignore_eos=True, temperature=0.0
        ),
    )
    if req.json_schema:  # constrained: ends with its grammar, max_tokens a cap
        msg.sampling.ignore_eos = False
        msg.sampling.json_schema = req.json_schema
    return msg


class GrpcBackend:
    name = "grpc"

    def __init__(self, ctx: BackendContext, channel: Any, stub: Any) -> None:
        self._ctx = ctx
        self._channel = channel
        self._stub = stub
        self._metadata = grpc_metadata(ctx)

    async def send(self, req: BenchRequest) -> RequestRecord:
        import grpc

        msg = generate_request(self._ctx, req)
        rec = RequestRecord(ok=False, prompt_len=req.prompt_len)
        start = time.perf_counter()
        last = start
        try:
            async for resp in self._stub.GenerateStream(msg, metadata=self._metadata):
                now = time.perf_counter()
                if any(c.token_ids for c in resp.completions):
                    if rec.ttft == 0.0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                if resp.HasField("usage"):
                    rec.output_len = resp.usage.completion_tokens
                    rec.cached_tokens = resp.usage.cached_prompt_tokens
        except grpc.aio.AioRpcError as err:  # a failed request is a data point, not a crash
            rec.error = f"{err.code().name}: {err.details()}"
            return rec
        rec.e2e = time.perf_counter() - start
        rec.ok = rec.output_len > 0
        if not rec.ok:
            rec.error = "no usage in the stream"
        return rec

    async def close(self) -> None:
        await self._channel.close()
