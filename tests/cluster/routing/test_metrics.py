"""The request kinds the ingresses count (cluster/routing/metrics.py): the kind follows the
engine's own SamplingParams, and the counter reaches Ray's exporter with its labels, every
protocol and kind created at 0."""

from __future__ import annotations

from typing import Any

from cluster.routing.metrics import PROTOCOLS, REQUEST_KINDS, request_kind
from tests.cluster.replica.test_metrics import (  # noqa: F401 - pytest fixtures
    exporter,
    metrics_url,
)
from tests.monitoring.promkit import Scrape, scrape, wait_for
from workers.pooling import Pooling
from workers.sampling_params import SamplingParams

KINDS = "ray_kvray_router_requests_by_kind_total"


def test_request_kind_follows_what_the_engine_is_asked() -> None:
    assert request_kind(SamplingParams()) == "generation"
    assert request_kind(SamplingParams(logprobs=2)) == "generation"
    assert request_kind(SamplingParams(max_tokens=1, pooling=Pooling("mean"))) == "embedding"
    assert request_kind(SamplingParams(prompt_logprobs=0, logprobs=1)) == "scoring"
    kinds = {
        request_kind(SamplingParams(**kw))
        for kw in ({}, {"pooling": Pooling()}, {"prompt_logprobs": 1})
    }
    assert kinds == set(REQUEST_KINDS)


def test_kinds_are_counted_per_protocol(exporter: Any) -> None:  # noqa: F811
    # Router series carry no replica label: compare against what earlier tests left.
    host, url = exporter
    every = [(p, k) for p in PROTOCOLS for k in REQUEST_KINDS]

    def values(s: Scrape) -> tuple[float | None, ...]:
        return tuple(s.value(KINDS, protocol=p, kind=k) for p, k in every)

    before = wait_for(lambda: values(scrape(url)), lambda v: None not in v, "zeroed kinds")
    host.call("router", "checked", "http", SamplingParams(max_tokens=1, pooling=Pooling()))
    host.call("router", "checked", "http", SamplingParams(max_tokens=1, pooling=Pooling()))
    host.call("router", "checked", "grpc", SamplingParams(prompt_logprobs=0))
    added = {("http", "embedding"): 2, ("grpc", "scoring"): 1}
    expected = tuple((b or 0) + added.get(pk, 0) for b, pk in zip(before, every, strict=True))
    wait_for(lambda: values(scrape(url)), lambda v: v == expected, "the counted kinds")
