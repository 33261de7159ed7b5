"""Stand-ins for the prefill and decode deployments of `Disaggregation` (tests/cluster/ingress/
test_pd.py): real engines behind attempt functions shaped like the handle calls, and a sink
that counts what the ingress reports (decisions, fallbacks, hand-offs, TTFT phases)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator

from cluster.errors import EngineDeadError
from cluster.ingress.pd import Disaggregation, PdPolicy
from cluster.messages import GenerateRequest
from workers import AsyncEngine
from workers.outputs import CompletionOutput, RequestOutput

_IDS = itertools.count()  # request ids the stand-ins gave (never reused, as a server's)


class Counts:
    def __init__(self) -> None:
        self.decisions: list[str] = []
        self.fallbacks: list[str] = []
        self.handoffs = 0
        self.ttfts: list[dict[str, float]] = []

    def decided(self, d: str) -> None:
        self.decisions.append(d)

    def fallback(self, r: str) -> None:
        self.fallbacks.append(r)

    def handed_off(self, _s: float) -> None:
        self.handoffs += 1

    def ttft(self, phases: dict[str, float]) -> None:
        self.ttfts.append(phases)


class Replicas:
    """The prefill and decode deployments' stand-ins; `prefill_fails`: "dies" (the prefill's
    attempt fails before it yields: its engine restarting) or "aborts" (the prefill replica
    ends the request aborted after a token: e.g. out of KV cache there)."""

    def __init__(
        self, engines: dict[str, AsyncEngine], prefill_fails: str = "", decode_dies_after: int = 0
    ) -> None:
        # decode_dies_after: the first decode call dies after this many outputs (0: never).
        self.engines = engines
        self.prefill_fails = prefill_fails
        self.decode_dies_after = decode_dies_after
        self.seen: list[tuple[str, GenerateRequest]] = []

    def attempt(self, name: str):  # noqa: ANN201
        async def call(request: GenerateRequest) -> AsyncIterator[RequestOutput]:
            self.seen.append((name, request))
            if name == "prefill" and self.prefill_fails == "dies":
                raise EngineDeadError("engine is restarting", replica="p", taken=False)
            if name == "prefill" and self.prefill_fails == "aborts":
                aborted = CompletionOutput(0, token_ids=[400], finish_reason="abort")
                yield RequestOutput("p", None, [], [aborted], finished=True)
                return
            rid = f"{request.request_id}.{next(_IDS)}"  # never reused, as a server's
            dies_after, n = (self.decode_dies_after if name == "decode" else 0), 0
            async with contextlib.aclosing(
                self.engines[name].generate_input(request.input, rid)
            ) as outs:
                async for out in outs:
                    yield out
                    n += 1
                    if n == dies_after:
                        self.decode_dies_after = 0  # the replica it moves to lives
                        raise EngineDeadError("engine died", replica="d")

        return call


def make_pd(engines: dict[str, AsyncEngine], replicas: Replicas, mode: str = "always"):  # noqa: ANN202
    counts = Counts()

    async def checker():  # noqa: ANN202
        return engines["decode"].input_checker

    pd = Disaggregation(
        PdPolicy(mode, step_tokens=32, block_size=16),
        replicas.attempt("prefill"),
        replicas.attempt("decode"),
        checker,
        counts,
    )
    return pd, counts


async def collect(outs: AsyncIterator[RequestOutput]) -> tuple[str, list[int], RequestOutput]:
    text, tokens, last = "", [], None
    async for out in outs:
        for c in out.outputs:
            text += c.delta_text
            tokens += c.delta_token_ids
        last = out
    assert last is not None and last.finished
    return text, tokens, last
