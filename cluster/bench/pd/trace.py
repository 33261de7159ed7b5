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

from cluster.bench.common.backend_types import BackendContext
from cluster.bench.common.backends import HttpBackend
from cluster.bench.common.workload import BenchRequest


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
    the order they ended. Sent as `kvray bench serve` sends them (greedy, ignore_eos)."""
    records: list[Record] = []
    backend = await HttpBackend.open(ctx)
    try:
        deadline = time.perf_counter() + shape.phase_s

        async def send(key: str, kind: str, length: int, out: int) -> None:
            rec = await backend.send(BenchRequest(tuple(prompt(shape, ids, key, length)), out))
            records.append(
                Record(key, kind, rec.ttft, rec.itl, rec.e2e, rec.output_len, rec.text, rec.error)
            )

        async def stream(s: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                key = f"{phase}:s{s}-{n}"
                await send(key, "steady", shape.steady_prompt_len, shape.steady_output_len)
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
    finally:
        await backend.close()
    return records
