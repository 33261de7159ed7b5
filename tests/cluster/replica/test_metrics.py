"""Engine, router and tenant metrics (cluster/{replica,routing,ingress}) the real way: an actor
records, Ray's agent exports (1 s interval), each test scrapes until real data shows up."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import ray

from tests.cluster.serve_helpers import RaySession
from tests.monitoring.promkit import (
    ENGINE_METRICS,
    KVRAY_METRICS,
    Scrape,
    documented_metrics,
    kvray_exposition,
    own_labels,
    run_promtool,
    scrape,
    wait_for,
)
from workers.core.stats import EngineStats
from workers.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "tiny"


class MetricsHost:
    """Stands where LLMServer and the ingresses hold their metrics objects."""

    def __init__(self, model: str, replica: str) -> None:
        from cluster.ingress.pd_metrics import PdMetrics
        from cluster.ingress.tenant_metrics import TenantMetrics
        from cluster.replica.metrics import EngineMetrics
        from cluster.routing.metrics import RouterMetrics

        self.engine = EngineMetrics(model=model, replica=replica)
        self.router, self.tenants = RouterMetrics(), TenantMetrics(["acme"])
        self.kv_share = self.engine.kv_share
        self.pd = PdMetrics()  # an ingress of an application with prefill replicas

    def call(self, target: str, method: str, *args: Any) -> None:
        getattr(getattr(self, target), method)(*args)


@pytest.fixture(scope="module")
def metrics_url(ray_session: RaySession) -> str:
    """The session's Ray instance exports on a free port, publishing every second."""
    return ray_session.metrics_url


@pytest.fixture
def exporter(metrics_url: str) -> Any:
    """A fresh metrics host per test; its own `replica` label keeps tests' series apart."""
    replica = f"replica-{uuid.uuid4().hex[:8]}"
    host = ray.remote(num_cpus=0)(MetricsHost).remote(MODEL, replica)
    try:
        yield Host(host, replica), metrics_url
    finally:
        ray.kill(host)


class Host:
    def __init__(self, actor: Any, replica: str) -> None:
        self.actor = actor
        self.replica = replica

    def call(self, target: str, method: str, *args: Any) -> None:
        ray.get(self.actor.call.remote(target, method, *args))

    def value(self, s: Scrape, name: str, **labels: str) -> float | None:
        return s.value(f"ray_{name}", model=MODEL, replica=self.replica, **labels)


def scrape_until(url: str, ok: Any, what: str) -> Scrape:
    return wait_for(lambda: scrape(url), ok, what)


Expected = list[tuple[str, dict[str, str], float]]


def until_values(url: str, host: Host, expected: Expected, what: str) -> Scrape:
    """Scrape until every expected value of this host's series is exported.

    Ray's agent exports metric by metric, so one metric having arrived says nothing about
    another (a histogram showed up a scrape before a counter recorded earlier). Waiting on
    all of them keeps each check exact without racing the exporter; a value that never
    comes is named when the wait gives up.
    """
    last: list[Scrape] = []

    def wrong() -> list[str]:
        last[:] = [scrape(url)]
        return [
            f"{name}{labels or ''}: {got} != {want}"
            for name, labels, want in expected
            if (got := host.value(last[0], name, **labels)) != want
        ]

    wait_for(wrong, lambda w: not w, what)
    return last[0]


def finished(
    prompt_len: int,
    gen_lens: list[int],
    reasons: list[str],
    t0: float,
    ttft: float,
    gaps: list[float],
) -> RequestOutput:
    token_times = [t0 + ttft]
    for gap in gaps:
        token_times.append(token_times[-1] + gap)
    return RequestOutput(
        request_id=f"r{t0}",
        prompt=None,
        prompt_token_ids=list(range(prompt_len)),
        outputs=[
            CompletionOutput(index=i, token_ids=list(range(n)), finish_reason=reason)
            for i, (n, reason) in enumerate(zip(gen_lens, reasons, strict=True))
        ],
        finished=True,
        metrics=RequestMetrics(
            arrival_time=t0,
            first_scheduled_time=t0 + 0.002,
            first_token_time=t0 + ttft,
            finished_time=token_times[-1],
            token_times=token_times,
            num_prompt_tokens=prompt_len,
            num_generation_tokens=sum(gen_lens),
        ),
    )


def test_counters_exist_at_zero_before_anything_happens(exporter: Any) -> None:
    """Zero-initialised series: rate() then sees the first preemption, 429 or abort."""
    host, url = exporter
    names = (
        "kvray_num_preemptions_total",
        "kvray_prefix_cache_queries_total",
        "kvray_prefix_cache_hits_total",
        "kvray_prompt_tokens_total",
        "kvray_generation_tokens_total",
    )
    until_values(
        url,
        host,
        [(name, {}, 0) for name in names]
        + [
            ("kvray_request_success_total", {"finish_reason": reason}, 0)
            for reason in ("stop", "length", "abort")
        ],
        "zero-initialised engine counters",
    )
    # Router series carry no replica label (earlier tests may have moved them): present is
    # what counts here.
    router_series = (
        [
            ("ray_kvray_router_routing_total", {"decision": d})
            for d in ("affinity", "load", "fallback")
        ]
        + [
            ("ray_kvray_router_rejected_total", {"reason": r})
            for r in ("queue_full", "unauthenticated")
        ]
        + [
            ("ray_kvray_router_requests_total", {"protocol": p, "code": c})
            for p, c in (("http", "200"), ("http", "429"), ("grpc", "RESOURCE_EXHAUSTED"))
        ]
    )
    scrape_until(
        url,
        lambda s: all(s.value(name, **labels) is not None for name, labels in router_series),
        "zero-initialised router counters",
    )


def test_stats_set_gauges_and_advance_counters_by_delta(exporter: Any) -> None:
    host, url = exporter
    snapshots = [
        EngineStats(num_requests_running=3, num_requests_waiting=5, kv_blocks_used=30,
                    kv_blocks_total=120, kv_cache_usage=0.25, prefix_cache_queries=100,
                    prefix_cache_hits=40, num_preemptions=2),
        EngineStats(num_requests_running=1, num_requests_waiting=0, kv_blocks_used=60,
                    kv_blocks_total=120, kv_cache_usage=0.5, prefix_cache_queries=150,
                    prefix_cache_hits=90, num_preemptions=5),
        # The engine was rebuilt: its cumulative counts restart from 0.
        EngineStats(num_requests_running=0, num_requests_waiting=0, kv_blocks_used=0,
                    kv_blocks_total=120, kv_cache_usage=0.0, prefix_cache_queries=10,
                    prefix_cache_hits=5, num_preemptions=1),
    ]  # fmt: skip
    for snap in snapshots[:2]:
        host.call("engine", "observe_stats", snap)
    until_values(
        url,
        host,
        [
            ("kvray_num_requests_running", {}, 1),
            ("kvray_num_requests_waiting", {}, 0),
            ("kvray_kv_cache_usage_ratio", {}, 0.5),
            ("kvray_kv_cache_blocks", {}, 120),
            ("kvray_prefix_cache_queries_total", {}, 150),
            ("kvray_prefix_cache_hits_total", {}, 90),
            ("kvray_num_preemptions_total", {}, 5),
        ],
        "gauges and counters after two snapshots",
    )

    host.call("engine", "observe_stats", snapshots[2])
    until_values(
        url,
        host,
        [
            ("kvray_prefix_cache_queries_total", {}, 160),
            ("kvray_prefix_cache_hits_total", {}, 95),
            ("kvray_num_preemptions_total", {}, 6),
            ("kvray_kv_cache_usage_ratio", {}, 0.0),
        ],
        "counters after an engine restart",
    )


def test_finished_requests_feed_tokens_outcomes_and_latency_histograms(exporter: Any) -> None:
    host, url = exporter
    outs = [
        finished(7, [4], ["stop"], 100.0, ttft=0.05, gaps=[0.012, 0.012, 0.012]),
        finished(20, [3, 5], ["length", "stop"], 200.0, ttft=1.2, gaps=[0.3, 0.0004, 0.3, 0.3]),
        finished(1, [0], ["abort"], 300.0, ttft=0.0, gaps=[]),
    ]
    for out in outs:
        host.call("engine", "observe_finished", out)
    ttft = "kvray_time_to_first_token_seconds_bucket"
    itl = "kvray_inter_token_latency_seconds_bucket"
    until_values(
        url,
        host,
        [
            ("kvray_time_to_first_token_seconds_count", {}, 3),
            # Token counters equal what the API's usage reports: prompt ids and every
            # sample's ids.
            ("kvray_prompt_tokens_total", {}, 7 + 20 + 1),
            ("kvray_generation_tokens_total", {}, 4 + 3 + 5 + 0),
            # One outcome per request; the most telling reason of its samples.
            ("kvray_request_success_total", {"finish_reason": "stop"}, 1),
            ("kvray_request_success_total", {"finish_reason": "length"}, 1),
            ("kvray_request_success_total", {"finish_reason": "abort"}, 1),
            # Bucket counts are exact in Ray's exporter (unlike _sum, rebuilt from midpoints).
            (ttft, {"le": "0.001"}, 1),  # the 0 s one
            (ttft, {"le": "0.06"}, 2),  # + 0.05 s
            (ttft, {"le": "1.0"}, 2),
            (ttft, {"le": "1.5"}, 3),  # + 1.2 s
            ("kvray_inter_token_latency_seconds_count", {}, 7),  # every gap
            (itl, {"le": "0.0005"}, 1),
            (itl, {"le": "0.015"}, 4),
            (itl, {"le": "0.2"}, 4),
            (itl, {"le": "0.4"}, 7),
            ("kvray_e2e_request_latency_seconds_count", {}, 3),
            ("kvray_request_queue_time_seconds_bucket", {"le": "0.0025"}, 3),
            ("kvray_request_prompt_tokens_count", {}, 3),
            ("kvray_request_prompt_tokens_bucket", {"le": "1.0"}, 1),
            ("kvray_request_prompt_tokens_bucket", {"le": "10.0"}, 2),
            ("kvray_request_generation_tokens_bucket", {"le": "5.0"}, 2),
            ("kvray_request_generation_tokens_bucket", {"le": "10.0"}, 3),
        ],
        "three finished requests",
    )


def test_an_aborted_request_counts_as_abort(exporter: Any) -> None:
    host, url = exporter
    host.call("engine", "observe_aborted")
    s = scrape_until(
        url,
        lambda s: host.value(s, "kvray_request_success_total", finish_reason="abort") == 1,
        "one abort",
    )
    assert host.value(s, "kvray_request_success_total", finish_reason="stop") == 0
    assert host.value(s, "kvray_time_to_first_token_seconds_count") is None


def test_step_token_counts_fill_the_iteration_histogram(exporter: Any) -> None:
    host, url = exporter
    host.call("engine", "observe_step_tokens", [1, 3, 512, 9000])
    s = scrape_until(
        url,
        lambda s: host.value(s, "kvray_iteration_tokens_count") == 4,
        "four engine steps",
    )
    assert host.value(s, "kvray_iteration_tokens_bucket", le="1.0") == 1
    assert host.value(s, "kvray_iteration_tokens_bucket", le="4.0") == 2
    assert host.value(s, "kvray_iteration_tokens_bucket", le="512.0") == 3
    assert host.value(s, "kvray_iteration_tokens_bucket", le="16384.0") == 4


def test_router_counters_carry_their_labels(exporter: Any) -> None:
    # Router series have no replica label: compare against what earlier tests left.
    host, url = exporter

    def router(s: Scrape) -> tuple[float, ...]:
        return tuple(
            s.value(name, **labels) or 0.0
            for name, labels in (
                ("ray_kvray_router_requests_total", {"protocol": "http", "code": "200"}),
                (
                    "ray_kvray_router_requests_total",
                    {"protocol": "grpc", "code": "RESOURCE_EXHAUSTED"},
                ),
                ("ray_kvray_router_routing_total", {"decision": "affinity"}),
                ("ray_kvray_router_rejected_total", {"reason": "queue_full"}),
            )
        )

    before = router(scrape(url))
    host.call("router", "request", "http", "200")
    host.call("router", "request", "http", "200")
    host.call("router", "request", "grpc", "RESOURCE_EXHAUSTED")
    host.call("router", "routing", "affinity")
    host.call("router", "rejected", "queue_full")
    host.call("router", "migration", "engine_died")
    host.call("router", "migration_resumed", 0.3)
    expected = tuple(b + d for b, d in zip(before, (2, 1, 1, 1), strict=True))
    scrape_until(url, lambda s: router(s) == expected, "router counters")


def feed_one_of_everything(host: Host) -> None:
    host.call(
        "engine",
        "observe_stats",
        EngineStats(
            kv_blocks_total=8,
            num_preemptions=1,
            structured_requests=2,
            grammar_cache_hits=1,
            grammar_compiles=1,
            grammar_compile_seconds=0.002,
            recent_grammar_compile_seconds=(0.002,),
            moe_expert_tokens=((2, 0), (1, 1)),  # a mixture-of-experts model's
        ),
    )
    host.call("engine", "observe_finished", finished(3, [2], ["stop"], 1.0, 0.01, [0.01]))
    host.call("engine", "observe_step_tokens", [3, 1])
    for call in (("request", "http", "200"), ("routing", "load"), ("rejected", "queue_full")):
        host.call("router", *call)
    host.call("tenants", "queue_time", "acme", 0.01)  # a histogram exists once observed
    host.call("kv_share", "pulled", 32, 0.004)
    host.call("pd", "handed_off", 0.02)
    host.call("pd", "ttft", {"prefill": 0.01})


def all_families(s: Scrape) -> bool:
    return all(f"ray_{n}" in s.types for n in KVRAY_METRICS)


def engine_samples(s: Scrape, host: Host) -> dict[str, list[Any]]:
    """Each engine metric's samples for this host's replica (a histogram's `_count`)."""
    return {
        name: s.find(
            f"ray_{name}_count" if kind == "histogram" else f"ray_{name}", replica=host.replica
        )
        for name, kind in ENGINE_METRICS.items()
    }


def test_exported_names_types_and_labels_are_the_documented_ones(exporter: Any) -> None:
    """Each metric of monitoring/README.md is scraped as ray_<name> with its type; no other."""
    host, url = exporter
    feed_one_of_everything(host)
    # Ray's agent exports metrics in batches that need not line up with one scrape: wait
    # until this replica's series of every engine metric has arrived, not just one of them.
    s = scrape_until(
        url,
        lambda s: (
            all_families(s)
            and host.value(s, "kvray_iteration_tokens_count") == 2
            and all(engine_samples(s, host).values())
        ),
        "every kvray metric family with this replica's series",
    )
    exported = {n: t for n, t in s.types.items() if n.startswith("ray_kvray_")}
    assert exported == {f"ray_{n}": t for n, t in KVRAY_METRICS.items()}
    for name, samples in engine_samples(s, host).items():
        for sample in samples:
            assert sample.labels["model"] == MODEL, name
    # Each family's own labels are the documented ones.
    for name, (kind, labels) in documented_metrics().items():
        series = f"ray_{name}_count" if kind == "histogram" else f"ray_{name}"
        assert {own_labels(x.labels) for x in s.find(series)} == {labels}, name


def test_promtool_accepts_the_kvray_families(exporter: Any) -> None:
    """`promtool check metrics` on the real scrape's kvray families. Ray's own per-process
    labels (WorkerId, NodeAddress, ...) are not kvray's to name and are left out."""
    host, url = exporter
    feed_one_of_everything(host)
    s = scrape_until(url, all_families, "kvray families")
    result = run_promtool("check", "metrics", stdin=kvray_exposition(s.text))
    assert result.returncode == 0, result.stdout + result.stderr
