"""The trace `kvray bench pd` replays, and its replay over HTTP.

Steady streams: S clients, each sending short prompts back to back (greedy, ignore_eos, a
fixed output length) for the phase's length. Bursts: every B seconds, K long prompts at once
(also streamed). Every request's prompt is fixed by the seed and its key (stream and number,
or burst and number), so the same key gets the same prompt in every set-up and its output
can be compared across them. A "quiet" phase replays the steady streams alone; a "bursty"
phase adds the bursts.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.bench.common.backend_types import BackendContext
from cluster.bench.common.backends import completions_target, http_session, sse_messages


@dataclass(frozen=True)
class TraceShape:
    streams: int
    steady_prompt_len: int
    steady_output_len: int
    burst_prompt_len: int
    burst_output_len: int
    burst_size: int
    burst_every_s: float
    phase_s: float
    seed: int


@dataclass
class Record:
    key: str  # "<phase>:s<stream>-<n>" or "<phase>:b<burst>-<n>"
    kind: str  # "steady" | "burst"
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between a stream's chunks
    e2e: float = 0.0
    tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        return (self.e2e - self.ttft) / max(1, self.tokens - 1)


def prompt(shape: TraceShape, ids: list[int], key: str, length: int) -> list[int]:
    rng = random.Random(f"{shape.seed}-{key}")
    return [rng.choice(ids) for _ in range(length)]


async def replay(
    ctx: BackendContext, shape: TraceShape, ids: list[int], phase: str, bursts: bool
) -> list[Record]:
    """One phase (module doc), its requests keyed under `phase`: every request's record, in
    the order they ended."""
    url, headers = completions_target(ctx)
    records: list[Record] = []
    async with http_session(ctx) as session:
        deadline = time.perf_counter() + shape.phase_s

        async def send(key: str, kind: str, length: int, out: int) -> None:
            body = {
                "model": ctx.model,
                "prompt": prompt(shape, ids, key, length),
                "max_tokens": out,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            records.append(await _stream(session, url, headers, body, key, kind))

        async def stream(s: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                await send(
                    f"{phase}:s{s}-{n}", "steady", shape.steady_prompt_len, shape.steady_output_len
                )
                n += 1

        async def burster() -> None:
            b = 0
            while True:
                await asyncio.sleep(shape.burst_every_s)
                if time.perf_counter() >= deadline:
                    return
                b += 1
                await asyncio.gather(
                    *(
                        send(
                            f"{phase}:b{b}-{k}",
                            "burst",
                            shape.burst_prompt_len,
                            shape.burst_output_len,
                        )
                        for k in range(shape.burst_size)
                    )
                )

        tasks = [stream(s) for s in range(shape.streams)]
        if bursts:
            tasks.append(burster())
        await asyncio.gather(*tasks)
    return records


async def _stream(
    session: Any, url: str, headers: dict[str, str], body: dict[str, Any], key: str, kind: str
) -> Record:
    rec = Record(key, kind)
    start = last = time.perf_counter()
    parts: list[str] = []
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for now, msg in sse_messages(resp):
                if msg.get("choices"):
                    if rec.ttft == 0.0:
                        rec.ttft = now - start
                    else:
                        rec.gaps.append(now - last)
                    last = now
                    parts.append(msg["choices"][0].get("text") or "")
                if msg.get("usage"):
                    rec.tokens = msg["usage"]["completion_tokens"]
    except Exception as err:  # a failed request is a data point
        rec.error = f"{type(err).__name__}: {err}"
        return rec
    rec.e2e = time.perf_counter() - start
    rec.text = "".join(parts)
    if rec.tokens == 0:
        rec.error = "no usage in the stream"
    return rec
