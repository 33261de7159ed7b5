"""Helpers shared by the metrics and monitoring tests: scraping Ray's exporter, promtool."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "monitoring"
RULES_DIR = MONITORING / "prometheus" / "rules"
DASHBOARD = MONITORING / "grafana" / "kvray-dashboard.json"
README = MONITORING / "README.md"

# The metrics table of monitoring/README.md (which adds the labels): name ->
# Prometheus type. Ray's exporter adds the `ray_` prefix.
KVRAY_METRICS: dict[str, str] = {
    "kvray_num_requests_running": "gauge",
    "kvray_num_requests_waiting": "gauge",
    "kvray_kv_cache_usage_ratio": "gauge",
    "kvray_kv_cache_blocks": "gauge",
    "kvray_engine_info": "gauge",
    "kvray_num_preemptions_total": "counter",
    "kvray_prompt_tokens_total": "counter",
    "kvray_generation_tokens_total": "counter",
    "kvray_prefix_cache_queries_total": "counter",
    "kvray_prefix_cache_hits_total": "counter",
    "kvray_kv_offload_blocks": "gauge",
    "kvray_kv_offload_bytes": "gauge",
    "kvray_kv_offload_capacity_bytes": "gauge",
    "kvray_kv_offload_hit_tokens_total": "counter",
    "kvray_kv_offload_copies_out_total": "counter",
    "kvray_kv_offload_copies_in_total": "counter",
    "kvray_kv_offload_evictions_total": "counter",
    "kvray_spec_decode_drafts_total": "counter",
    "kvray_spec_decode_draft_tokens_total": "counter",
    "kvray_spec_decode_accepted_tokens_total": "counter",
    "kvray_kv_share_pulls_total": "counter",
    "kvray_kv_share_pulled_tokens_total": "counter",
    "kvray_kv_share_published_blocks_total": "counter",
    "kvray_kv_share_dropped_blocks_total": "counter",
    "kvray_kv_share_refused_blocks_total": "counter",
    "kvray_kv_share_pull_seconds": "histogram",
    "kvray_request_success_total": "counter",
    "kvray_time_to_first_token_seconds": "histogram",
    "kvray_inter_token_latency_seconds": "histogram",
    "kvray_e2e_request_latency_seconds": "histogram",
    "kvray_request_queue_time_seconds": "histogram",
    "kvray_request_prompt_tokens": "histogram",
    "kvray_request_generation_tokens": "histogram",
    "kvray_iteration_tokens": "histogram",
    "kvray_structured_requests_total": "counter",
    "kvray_grammar_cache_hits_total": "counter",
    "kvray_grammar_compile_seconds": "histogram",
    "kvray_lora_requests_total": "counter",
    "kvray_lora_prompt_tokens_total": "counter",
    "kvray_lora_generation_tokens_total": "counter",
    "kvray_lora_time_to_first_token_seconds": "histogram",
    "kvray_lora_slots_used": "gauge",
    "kvray_lora_slots": "gauge",
    "kvray_lora_loads_total": "counter",
    "kvray_lora_evictions_total": "counter",
    "kvray_lora_load_seconds_total": "counter",
    "kvray_moe_expert_tokens_total": "counter",
    "kvray_moe_expert_load_imbalance_ratio": "gauge",
    "kvray_router_requests_total": "counter",
    "kvray_router_requests_by_kind_total": "counter",
    "kvray_router_routing_total": "counter",
    "kvray_router_rejected_total": "counter",
    "kvray_router_lora_routing_total": "counter",
    "kvray_request_migrations_total": "counter",
    "kvray_migration_resume_seconds": "histogram",
    "kvray_pd_decisions_total": "counter",
    "kvray_pd_fallback_total": "counter",
    "kvray_pd_handoff_seconds": "histogram",
    "kvray_pd_ttft_seconds": "histogram",
    "kvray_tenant_requests_total": "counter",
    "kvray_tenant_tokens_total": "counter",
    "kvray_tenant_rejected_total": "counter",
    "kvray_tenant_queue_time_seconds": "histogram",
}
# Recorded by the ingresses (no model/replica labels); the rest by engine replicas.
MIGRATION_METRICS = ("kvray_request_migrations_total", "kvray_migration_resume_seconds")
# Disaggregation's, by the ingresses of an application with prefill replicas only.
PD_METRICS = (
    "kvray_pd_decisions_total",
    "kvray_pd_fallback_total",
    "kvray_pd_handoff_seconds",
    "kvray_pd_ttft_seconds",
)
INGRESS_METRICS = {
    n
    for n in KVRAY_METRICS
    if n.startswith(("kvray_router_", "kvray_tenant_")) or n in MIGRATION_METRICS + PD_METRICS
}
ENGINE_METRICS = {n: t for n, t in KVRAY_METRICS.items() if n not in INGRESS_METRICS}
# Histograms that exist only once their event happened (Ray exports no empty histogram):
# a live scrape without a replica failure lacks them.
# So do the mixture-of-experts metrics on a dense model (the live stack serves the demo).
EVENT_METRICS = {
    "kvray_migration_resume_seconds",
    "kvray_moe_expert_tokens_total",
    "kvray_moe_expert_load_imbalance_ratio",
    "kvray_kv_share_pull_seconds",  # a pull from the cluster KV tier (off by default)
    *PD_METRICS,  # prefill replicas (none by default)
}

T = TypeVar("T")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Scrape:
    """One scrape of a Prometheus text endpoint."""

    text: str
    types: dict[str, str]  # family name as exposed (a counter's with `_total`) -> type
    samples: list[Sample]

    def find(self, name: str, **labels: str) -> list[Sample]:
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float | None:
        """Sum over the matching series (Ray adds per-process labels); None when absent."""
        found = self.find(name, **labels)
        return sum(s.value for s in found) if found else None

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def parse(text: str) -> Scrape:
    """The exposition text parsed by prometheus_client (raises ValueError on a bad line)."""
    from prometheus_client.parser import text_string_to_metric_families

    types: dict[str, str] = {}
    samples: list[Sample] = []
    for family in text_string_to_metric_families(text):
        # The parser names a counter family without `_total` (OpenMetrics style); its
        # samples, what PromQL and the exporter's `# TYPE` line use, keep the suffix.
        exposed = f"{family.name}_total" if family.type == "counter" else family.name
        types[exposed] = family.type
        samples += [Sample(s.name, dict(s.labels), float(s.value)) for s in family.samples]
    return Scrape(text, types, samples)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return parse(resp.read().decode())


def wait_for(
    produce: Callable[[], T], ok: Callable[[T], bool], what: str, timeout_s: float = 90.0
) -> T:
    """Poll `produce` until `ok` holds. The bound only stops a broken run from hanging: Ray
    publishes on its export interval, so the wait itself is expected and never asserted on."""
    deadline = time.monotonic() + timeout_s
    last = produce()
    while not ok(last):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}; last value: {last!r}"[:4000])
        time.sleep(0.5)
        last = produce()
    return last


def until_rated(
    scalar: Callable[[str], float | None], names: list[str], more: Callable[[int], object]
) -> None:
    """Until every histogram in `names` has a positive rate, runs `more(k)`, another small wave
    of load: a series is born on the replica that first observes it, and has no increase for
    rate() until that replica observes again (it may have met that kind of request last)."""

    def flat() -> list[str]:
        return [n for n in names if not scalar(f"sum(rate({n}_count[5m]))")]

    for k in range(4):
        try:
            wait_for(flat, lambda v: v == [], "a rate for every histogram", timeout_s=20)
            return
        except AssertionError:
            more(k)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool missing: run monitoring/install_prometheus.sh")
    return path


def run_promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], input=stdin, capture_output=True, text=True, timeout=120
    )


# Labels Ray's exporter adds to every series. Their CamelCase spelling is Ray's choice, so the
# naming lint of kvray's metrics leaves them out.
RAY_LABELS = frozenset(("Component", "NodeAddress", "SessionName", "Version", "WorkerId"))
# ... and OpenTelemetry's instrumentation-scope labels, which Ray's OTel-based exporter adds.
OTEL_LABEL_PREFIX = "otel_scope_"


def own_labels(labels: dict[str, str]) -> frozenset[str]:
    """The label names a series was recorded with: less those the exporter adds, and `le`."""
    return frozenset(
        k for k in labels if k not in RAY_LABELS and not k.startswith(OTEL_LABEL_PREFIX)
    ) - {"le"}


def kvray_exposition(text: str) -> str:
    """Only the ray_kvray_* families of an exposition (HELP, TYPE, samples), less Ray's
    CamelCase labels, written back out in the text format by prometheus_client."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    families = []
    for family in text_string_to_metric_families(text):
        if family.name.startswith("ray_kvray_"):
            family.samples = [
                s._replace(labels={k: v for k, v in s.labels.items() if k not in RAY_LABELS})
                for s in family.samples
            ]
            families.append(family)

    class Parsed:  # a prometheus_client collector of the families parsed above
        def collect(self) -> list:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Parsed())
    return generate_latest(registry).decode()


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """monitoring/README.md's metrics table: name -> (type, label names)."""
    # Labels: a comma list, or "—" for a family without labels of its own.
    row = re.compile(r"^\| `(kvray_[a-z0-9_]+)` \| (gauge|counter|histogram) \| ([a-z_, ]+|—) \|")
    table: dict[str, tuple[str, frozenset[str]]] = {}
    for line in README.read_text().splitlines():
        if m := row.match(line):
            names = () if m.group(3) == "—" else m.group(3).split(",")
            labels = frozenset(label.strip() for label in names)
            table[m.group(1)] = (m.group(2), labels)
    return table


# Values for the dashboard's template variables when its queries run outside Grafana.
DASHBOARD_VARIABLES: dict[str, str] = {
    "__rate_interval": "1m",
    "model": ".*",
    "replica": ".*",
    "peak_tokens_per_replica": "500",
    "target_tokens_per_s": "2000",
    "target_waiting_requests": "4",
    "target_kv_cache_usage": "0.8",
    "serve_deployment": "LLMServer",
}


def load_dashboard() -> dict:
    import json

    return json.loads(DASHBOARD.read_text())


def dashboard_queries(
    dashboard: dict, variables: dict[str, str] | None = None
) -> list[tuple[str, str]]:
    """(panel title, PromQL with template variables substituted) for every panel target."""
    values = {**DASHBOARD_VARIABLES, **(variables or {})}

    def substitute(expr: str) -> str:
        # Longest names first so $model never eats part of a longer variable name.
        for name in sorted(values, key=len, reverse=True):
            expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
        if "$" in expr:
            raise AssertionError(f"unknown template variable left in {expr!r}")
        return expr

    return [
        (panel["title"], substitute(target["expr"]))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def rule_expressions() -> list[tuple[str, str]]:
    """(rule name, expr) of every recording and alert rule shipped."""
    import yaml

    out: list[tuple[str, str]] = []
    for path in sorted(RULES_DIR.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                out.append((rule.get("record") or rule["alert"], rule["expr"]))
    return out


def referenced_metric_names(exprs: list[str]) -> set[str]:
    """Scraped metric names (ray_...) used by PromQL expressions."""
    return {m for e in exprs for m in re.findall(r"\bray_[a-zA-Z0-9_]+", e)}


def dashboard_histograms() -> set[str]:
    """The scraped histograms (ray_...) the dashboard's queries read the buckets of, but those
    of events a load may not cause (EVENT_METRICS)."""
    exprs = [e for _, e in dashboard_queries(load_dashboard(), {"__rate_interval": "5m"})]
    names = {m for e in exprs for m in re.findall(r"\b(ray_[a-zA-Z0-9_]+)_bucket\b", e)}
    return {n for n in names if n.removeprefix("ray_") not in EVENT_METRICS}
