"""Backends of `kvray bench serve`: one streaming request in, one RequestRecord out.

- http:      streaming /v1/completions over aiohttp (the full path: proxy, ingress, router,
             replica), token-id prompts, ignore_eos + max_tokens so lengths are exact.
- inprocess: the same request on an AsyncEngine in this process (no Ray, no HTTP): the
             baseline the HTTP path is measured against.
- grpc:      provided by grpc_backend.py as `open_grpc_backend(ctx) -> Backend`.

A backend is opened with a BackendContext, used by concurrent `send` calls, then closed; the
types every backend shares are in backend_types.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from cluster.bench.common.backend_types import Backend, BackendContext, RequestRecord
from cluster.bench.common.grpc_backend import open_grpc_backend
from cluster.bench.common.workload import BenchRequest

BACKENDS = ("http", "inprocess", "grpc")
__all__ = ["BACKENDS", "Backend", "BackendContext", "RequestRecord", "open_backend"]


async def open_backend(name: str, ctx: BackendContext) -> Backend:
    """The dispatch point: backend name -> an opened backend."""
    if name == "http":
        return await HttpBackend.open(ctx)
    if name == "inprocess":
        return await InProcessBackend.open(ctx)
    if name == "grpc":
        return await open_grpc_backend(ctx)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")


def completions_target(ctx: BackendContext) -> tuple[str, dict[str, str]]:
    """The server's /v1/completions URL and the request headers (the API key's, if any)."""
    headers = {"Content-Type": "application/json"}
    if ctx.api_key:
        headers["Authorization"] = f"Bearer {ctx.api_key}"
    return f"{(ctx.base_url or '').rstrip('/')}/v1/completions", headers


def stream_body(ctx: BackendContext, req: BenchRequest) -> dict[str, Any]:
    """A bench request as a streamed /v1/completions body: greedy, ignore_eos, usage at the end."""
    return {
        "model": req.model or ctx.model,
        "prompt": list(req.prompt_ids),
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def http_session(ctx: BackendContext) -> Any:
    """An aiohttp session for a benchmark's requests to --base-url."""
    import aiohttp

    if not ctx.base_url:
        raise ValueError("the http backend needs --base-url (or --launch)")
    # No connection cap: --max-concurrency is the only limit on requests in flight.
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def sse_messages(resp: Any) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """(arrival time, parsed JSON) of each `data:` frame of an SSE response, [DONE] left out."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            if frame.startswith(b"data: ") and frame[6:] != b"[DONE]":
                yield time.perf_counter(), json.loads(frame[6:])


class HttpBackend:
    name = "http"

    def __init__(self, ctx: BackendContext, session: Any) -> None:
        self._ctx = ctx
        self._session = session
        self._url, self._headers = completions_target(ctx)

    @staticmethod
    async def open(ctx: BackendContext) -> HttpBackend:
        return HttpBackend(ctx, http_session(ctx))

    async def send(self, req: BenchRequest) -> RequestRecord:
        body = stream_body(self._ctx, req)
        if req.json_schema:  # constrained: ends with its grammar, max_tokens a cap
            body["ignore_eos"] = False
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": json.loads(req.json_schema)},
            }
        rec = RequestRecord(ok=False, prompt_len=req.prompt_len)
        start = time.perf_counter()
        last = start
        parts: list[str] = []
        try:
            async with self._session.post(self._url, json=body, headers=self._headers) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return rec
                async for now, msg in sse_messages(resp):
                    if msg.get("error"):
                        rec.error = str(msg["error"].get("message"))
                        return rec
                    if msg.get("choices"):
                        if rec.ttft == 0.0:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        last = now
                        parts.append(msg["choices"][0].get("text") or "")
                    usage = msg.get("usage")
                    if usage:
                        rec.output_len = usage["completion_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = int(details.get("cached_tokens") or 0)
        except Exception as err:  # a failed request is a data point, not a crash
            rec.error = f"{type(err).__name__}: {err}"
            return rec
        rec.e2e = time.perf_counter() - start
        rec.text = "".join(parts)
        rec.ok = rec.output_len > 0
        if not rec.ok:
            rec.error = "no usage in the stream"
        return rec

    async def close(self) -> None:
        await self._session.close()


class InProcessBackend:
    name = "inprocess"

    def __init__(self, engine: Any, lora_modules: dict[str, str] | None = None) -> None:
        self._engine = engine
        self._ids = 0
        # Adapter name -> LoRARequest; ids 1, 2, ... in name order (a server assigns its own).
        self._loras = _lora_requests(lora_modules or {})

    @staticmethod
    async def open(ctx: BackendContext) -> InProcessBackend:
        import asyncio

        from workers import AsyncEngine, EngineArgs

        if ctx.torch_threads:
            import torch

            torch.set_num_threads(ctx.torch_threads)
        args = EngineArgs(model=ctx.model_dir, **ctx.engine_kwargs)
        engine = await asyncio.to_thread(AsyncEngine, args)
        return InProcessBackend(engine, ctx.lora_modules)

    async def send(self, req: BenchRequest) -> RequestRecord:
        from workers import SamplingParams

        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)
        if req.json_schema:  # constrained: ends with its grammar, max_tokens a cap
            from workers.structured import StructuredOutputs

            spec = StructuredOutputs.from_schema(json.loads(req.json_schema))
            params = SamplingParams(
                max_tokens=req.output_len, temperature=0.0, structured_outputs=spec
            )
        self._ids += 1
        rec = RequestRecord(ok=False, prompt_len=req.prompt_len)
        start = time.perf_counter()
        last = start
        out = None
        try:
            inp = self._engine.input_checker.check(list(req.prompt_ids), params)
            if req.model:
                inp = replace(inp, lora=self._loras[req.model])
            async for out in self._engine.generate_input(inp, f"b{self._ids}"):
                now = time.perf_counter()
                if out.outputs[0].delta_token_ids:
                    if rec.ttft == 0.0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
        except Exception as err:
            rec.error = f"{type(err).__name__}: {err}"
            return rec
        rec.e2e = time.perf_counter() - start
        if out is not None:
            rec.output_len = len(out.outputs[0].token_ids)
            rec.cached_tokens = out.num_cached_tokens
        rec.ok = rec.output_len > 0
        return rec

    async def close(self) -> None:
        import asyncio

        await asyncio.to_thread(self._engine.shutdown)


def _lora_requests(modules: dict[str, str]) -> dict[str, Any]:
    from workers.lora.request import LoRARequest

    named = sorted(modules.items())
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(named)}
