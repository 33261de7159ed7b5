"""The tenant gate: admission charges the tenant the engine inputs were checked for; each engine
request's end gives back what it did not use and counts it by tenant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.config.keys_file import Quota
from cluster.errors import QueueFullError
from cluster.ingress.prepare import Outputs, Prepared
from cluster.ingress.quotas import QuotaExceededError, Quotas
from cluster.ingress.tenant_gate import TenantGate
from cluster.ingress.tenants import TenantAuth, bind_tenant, current_tenant
from cluster.messages import GenerateRequest
from workers.inputs import EngineInput, InputChecker
from workers.outputs import CompletionOutput, RequestMetrics, RequestOutput
from workers.sampling_params import SamplingParams

PROMPT = tuple(range(10))
PROMPT_PARAMS = SamplingParams(max_tokens=50)


CHECKER = InputChecker(vocab_size=1000, max_model_len=4096)


class Checkers:
    async def input_checker(self) -> InputChecker:
        return CHECKER


class Recorder:
    """What the gate tells its metrics (TenantMetrics' methods)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def admitted(self, tenant: str) -> None:
        self.events.append(("admitted", tenant))

    def rejected(self, tenant: str, reason: str) -> None:
        self.events.append(("rejected", tenant, reason))

    def tokens(self, tenant: str, count: int) -> None:
        self.events.append(("tokens", tenant, count))

    def queue_time(self, tenant: str, seconds: float) -> None:
        self.events.append(("queue_time", tenant, seconds))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _prepared(max_tokens: int = 50, prompts: int = 1, tenant: str | None = None) -> Prepared:
    """A request checked, as the ingress checks it, for `tenant` (None: the current one)."""
    params = SamplingParams(max_tokens=max_tokens)
    request = CHECKER.request(params, tenant=tenant or current_tenant())
    inputs = tuple(request.input(PROMPT) for _ in range(prompts))
    return Prepared(params, inputs, Outputs(None, None))


async def _admit(gate: TenantGate, prepared: Prepared) -> Prepared:
    await gate.admit(prepared)
    return prepared


def _gate(quota: Quota) -> tuple[TenantGate, Recorder]:
    recorder = Recorder()
    quotas = Quotas({"acme": quota}, clock=Clock())
    return TenantGate(Checkers(), quotas, recorder), recorder  # type: ignore[arg-type]


def _as(tenant: str, coro: Any) -> Any:
    """Runs `coro` in a request task of `tenant` (as the guard binds it)."""

    async def run() -> Any:
        bind_tenant(TenantAuth(header="x-tenant"), "/v1/completions", {"x-tenant": tenant})
        return await coro()

    return asyncio.run(run())


def _final(generated: int) -> RequestOutput:
    sample = CompletionOutput(0, token_ids=list(range(generated)), finish_reason="length")
    metrics = RequestMetrics(arrival_time=5.0, first_scheduled_time=5.25)
    return RequestOutput("r", None, list(PROMPT), [sample], finished=True, metrics=metrics)


async def _stream(*outs: RequestOutput, fail: Exception | None = None) -> AsyncIterator[Any]:
    for out in outs:
        yield out
    if fail is not None:
        raise fail


async def _drain(gate: TenantGate, request: GenerateRequest, stream: Any) -> list[Any]:
    return [out async for out in gate.metered(stream, request)]


def test_admit_charges_the_tenant_the_inputs_were_checked_for() -> None:
    gate, rec = _gate(Quota(tokens_per_s=1, tokens_burst=130))
    prepared = _as("acme", lambda: _admit(gate, _prepared(max_tokens=50, prompts=2)))
    assert [inp.tenant for inp in prepared.inputs] == ["acme", "acme"]
    assert rec.events == [("admitted", "acme")]
    # 2 x (10 + 50) = 120 of 130 taken: the next 60 are refused, counted as quota_tokens.
    with pytest.raises(QuotaExceededError, match="'acme' is over its tokens_per_s quota"):
        _as("acme", lambda: gate.admit(_prepared()))
    assert rec.events[-1] == ("rejected", "acme", "quota_tokens")
    # The inputs' tenant is charged, whoever's task admits them; inputs naming none: the current.
    with pytest.raises(QuotaExceededError, match="'acme'"):
        _as("other", lambda: gate.admit(_prepared(tenant="acme")))
    unnamed = Prepared(PROMPT_PARAMS, (EngineInput(PROMPT, PROMPT_PARAMS),), Outputs(None, None))
    _as("other", lambda: gate.admit(unnamed))
    assert rec.events[-1] == ("admitted", "other")


def test_a_request_that_stops_early_gives_back_what_it_did_not_use() -> None:
    gate, rec = _gate(Quota(tokens_per_s=1, tokens_burst=120))

    async def run() -> None:
        (first,) = (await _admit(gate, _prepared(max_tokens=50))).requests("a")
        (second,) = (await _admit(gate, _prepared(max_tokens=50))).requests("b")
        with pytest.raises(QuotaExceededError):  # 120 taken, nothing back yet
            await gate.admit(_prepared(max_tokens=50))
        outs = await _drain(gate, first, _stream(_final(generated=5)))
        assert len(outs) == 1
        await gate.admit(_prepared(max_tokens=35))  # 45 of its 60 came back: 10 + 35 fit
        await _drain(gate, second, _stream(_final(generated=50)))

    _as("acme", run)
    assert ("tokens", "acme", 15) in rec.events and ("tokens", "acme", 60) in rec.events
    assert ("queue_time", "acme", 0.25) in rec.events


def test_a_full_replica_queue_gives_everything_back_and_counts_queue_full() -> None:
    gate, rec = _gate(Quota(tokens_per_s=1, tokens_burst=60))

    async def run() -> None:
        (request,) = (await _admit(gate, _prepared())).requests("a")
        with pytest.raises(QueueFullError):
            await _drain(gate, request, _stream(fail=QueueFullError("full")))
        await gate.admit(_prepared())  # the 60 tokens are back

    _as("acme", run)
    assert ("rejected", "acme", "queue_full") in rec.events


def test_a_failure_after_some_output_keeps_only_what_was_used() -> None:
    gate, rec = _gate(Quota(tokens_per_s=1, tokens_burst=60))
    delta = RequestOutput("r", None, [], [CompletionOutput(0, delta_token_ids=[1, 2, 3])])

    async def run() -> None:
        (request,) = (await _admit(gate, _prepared())).requests("a")
        with pytest.raises(RuntimeError):
            await _drain(gate, request, _stream(delta, fail=RuntimeError("engine died")))
        await gate.admit(_prepared(max_tokens=37))  # 60 - 13 used = 47 back: 10 + 37 fit
        with pytest.raises(QuotaExceededError):
            await gate.admit(_prepared(max_tokens=1))

    _as("acme", run)
    assert ("tokens", "acme", 13) in rec.events
    assert not any(e[0] == "rejected" and e[2] == "queue_full" for e in rec.events)


def test_an_abandoned_request_keeps_its_charge() -> None:
    gate, _ = _gate(Quota(tokens_per_s=1, tokens_burst=60))

    async def run() -> None:
        (request,) = (await _admit(gate, _prepared())).requests("a")
        delta = RequestOutput("r", None, [], [CompletionOutput(0, delta_token_ids=[1])])
        outs = gate.metered(_stream(delta, delta), request)
        await outs.__anext__()
        await outs.aclose()  # the client left
        with pytest.raises(QuotaExceededError):
            await gate.admit(_prepared(max_tokens=1))

    _as("acme", run)


def test_without_quotas_nothing_is_charged_and_tenants_still_travel() -> None:
    gate = TenantGate(Checkers())

    async def run() -> None:
        for _ in range(100):
            prepared = await _admit(gate, _prepared(max_tokens=4000))
            (request,) = prepared.requests("x")
            assert request.input.tenant == "zed"
            await _drain(gate, request, _stream(_final(generated=1)))

    _as("zed", run)
