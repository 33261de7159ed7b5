"""The mixed workload of `kvray bench serve --chaos`: request i from (seed, i) alone, the mix's
shares, each request's OpenAI body, the priorities flag."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from cluster.bench.chaos.workload import (
    STRUCTURED_MAX_TOKENS,
    ChaosMix,
    ChaosRequest,
    describe_mix,
    http_request,
    parse_priorities,
    request_at,
)

TOKENS = list(range(300, 3000))

# -- the workload -----------------------------------------------------------------------------


def test_request_i_depends_only_on_the_seed_and_i() -> None:
    mix = ChaosMix()
    a = [request_at(mix, 7, i, TOKENS) for i in range(50)]
    assert a == [request_at(mix, 7, i, TOKENS) for i in range(50)]
    assert request_at(mix, 7, 30, TOKENS) == a[30]  # whatever was drawn before it
    assert a != [request_at(mix, 8, i, TOKENS) for i in range(50)]


def test_the_mix_has_its_shares() -> None:
    mix = ChaosMix(tenants=4, priorities=parse_priorities("-1:0.2,0:0.6,5:0.2"))
    reqs = [request_at(mix, 1, i, TOKENS) for i in range(6000)]
    n = len(reqs)

    def share(pred: Any) -> float:
        return sum(1 for r in reqs if pred(r)) / n

    assert share(lambda r: r.api == "chat") == pytest.approx(0.5, abs=0.03)
    assert share(lambda r: r.stream) == pytest.approx(0.5, abs=0.03)
    assert share(lambda r: r.seed is not None) == pytest.approx(0.5, abs=0.03)
    assert share(lambda r: r.structured) == pytest.approx(0.2, abs=0.03)
    prios = Counter(r.priority for r in reqs)
    assert prios[0] / n == pytest.approx(0.6, abs=0.03) and set(prios) == {-1, 0, 5}
    assert prios[-1] / n == pytest.approx(0.2, abs=0.03)
    tenants = Counter(r.tenant for r in reqs)
    assert set(tenants) == {0, 1, 2, 3} and all(abs(v / n - 0.25) < 0.03 for v in tenants.values())
    for r in reqs:
        if r.structured:
            assert r.max_tokens == STRUCTURED_MAX_TOKENS
        else:
            assert 16 <= r.max_tokens <= 128
        if r.api == "completions":
            assert 8 <= len(r.prompt_ids) <= 128 and set(r.prompt_ids) <= set(TOKENS)
        else:
            assert r.message and not r.prompt_ids
    seeds = [r.seed for r in reqs if r.seed is not None]
    assert len(set(seeds)) > 0.99 * len(seeds)  # each seeded request its own seed


def test_each_request_is_sent_as_its_openai_body() -> None:
    base = {"max_tokens": 20, "priority": 5, "tenant": 1}
    route, body = http_request(
        ChaosRequest(0, "completions", stream=True, seed=9, prompt_ids=(5, 6), **base), "m"
    )
    assert route == "/v1/completions" and body["prompt"] == [5, 6] and body["priority"] == 5
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["seed"], body["temperature"], body["ignore_eos"]) == (9, 0.8, True)
    route, body = http_request(
        ChaosRequest(1, "chat", stream=False, schema="person", message="hi there", **base), "m"
    )
    assert route == "/v1/chat/completions" and body["messages"][0]["content"] == "hi there"
    assert body["temperature"] == 0.0 and "seed" not in body and "stream_options" not in body
    assert "ignore_eos" not in body  # a structured request ends with its grammar
    assert body["response_format"]["json_schema"]["schema"]["required"] == ["name", "age", "email"]


def test_the_workload_description_is_json() -> None:
    assert json.loads(json.dumps(describe_mix(ChaosMix())))["tenants"] == 3
