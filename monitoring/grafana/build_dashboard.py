"""Builds kvray's Grafana capacity dashboard: `python monitoring/grafana/build_dashboard.py`.

Writes monitoring/grafana/kvray-dashboard.json, the file Grafana imports and the Helm chart
ships; tests/monitoring/test_dashboard.py fails when the two drift apart. Standard library
only: a dashboard is plain JSON, and generating it keeps the PromQL of sibling panels
consistent (same selectors, same quantiles) where hand-editing 30 panels would not.

Metric names are the ones Ray's metrics exporter produces (DESIGN.md's names with `ray_`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUTPUT = Path(__file__).with_name("kvray-dashboard.json")

DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model=~"$model"'
MR = 'model=~"$model", replica=~"$replica"'
RI = "$__rate_interval"
SERVE = 'deployment="$serve_deployment"'
# Error classes across both protocols: HTTP status codes and gRPC status names.
REJECTED_CODES = "429|RESOURCE_EXHAUSTED"
SERVER_ERROR_CODES = "5..|INTERNAL|UNAVAILABLE|UNKNOWN|DATA_LOSS"
OK_CODES = "2..|OK"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 8
    height: int = 8
    extra_defaults: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def quantiles(
    metric: str, selector: str, qs: tuple[float, ...], by: str = "", name: str = ""
) -> tuple[Target, ...]:
    """histogram_quantile targets, one per quantile, summed over replicas unless `by`."""
    group = f"{by}, le" if by else "le"
    prefix = (f"{{{{{by}}}}} " if by else "") + (f"{name} " if name else "")
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({group}) "
            f"(rate({metric}_bucket{{{selector}}}[{RI}])))",
            f"{prefix}p{round(q * 100)}",
        )
        for q in qs
    )


def rate(metric: str, selector: str = "", by: str = "") -> str:
    sel = f"{{{selector}}}" if selector else ""
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} (rate({metric}{sel}[{RI}]))"


def code_ratio(codes: str) -> str:
    # `or vector(0)`: no error series yet means a 0 ratio, not an empty panel.
    return (
        f'(sum(rate(ray_kvray_router_requests_total{{code=~"{codes}"}}[{RI}])) or vector(0))'
        f" / sum(rate(ray_kvray_router_requests_total[{RI}]))"
    )


ENGINE_REPLICAS = f"count(ray_kvray_kv_cache_blocks{{{M}}})"
GEN_RATE = rate("ray_kvray_generation_tokens_total", M)
P3 = (0.5, 0.9, 0.99)

ROWS: tuple[Row, ...] = (
    Row(
        "Overview",
        (
            Panel(
                "Request rate",
                "Requests answered per second by the HTTP and gRPC ingresses, all status codes.",
                (Target(rate("ray_kvray_router_requests_total")),),
                unit="reqps",
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Output tokens/s",
                "Generated tokens per second over the selected models (counted when each "
                "request finishes).",
                (Target(GEN_RATE),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Engine replicas",
                "Engine replicas reporting metrics. A replica's series disappear about two Ray "
                "export intervals after its process dies.",
                (Target(ENGINE_REPLICAS),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Serve replicas healthy / target",
                "Ray Serve's own view of the LLM deployment: replicas passing health checks and "
                "the replica count its autoscaler (or num_replicas) asks for.",
                (
                    Target(f"sum(ray_serve_deployment_replica_healthy{{{SERVE}}})", "healthy"),
                    Target(f"max(ray_serve_autoscaling_target_replicas{{{SERVE}}})", "target"),
                ),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "TTFT p99",
                "99th percentile time to first token over the selected models.",
                quantiles("ray_kvray_time_to_first_token_seconds", M, (0.99,)),
                unit="s",
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Server error ratio",
                "Share of requests answered with a 5xx (HTTP) or INTERNAL / UNAVAILABLE / "
                "UNKNOWN / DATA_LOSS (gRPC).",
                (Target(code_ratio(SERVER_ERROR_CODES)),),
                unit="percentunit",
                kind="stat",
                width=4,
                height=4,
            ),
        ),
    ),
    Row(
        "Traffic",
        (
            Panel(
                "Token throughput",
                "Prompt and generated tokens per second, per model. Tokens are counted when a "
                "request finishes, so long generations show up at their end.",
                (
                    Target(rate("ray_kvray_prompt_tokens_total", M, "model"), "{{model}} prompt"),
                    Target(
                        rate("ray_kvray_generation_tokens_total", M, "model"),
                        "{{model}} generation",
                    ),
                ),
            ),
            Panel(
                "Requests by protocol and status",
                "Ingress answers per second by protocol (http, grpc) and status code.",
                (
                    Target(
                        rate("ray_kvray_router_requests_total", by="protocol, code"),
                        "{{protocol}} {{code}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Finished requests by reason",
                "Requests leaving the engines per second: stop (EOS / stop sequence), length "
                "(max_tokens), abort (client went away or cancelled).",
                (
                    Target(
                        rate("ray_kvray_request_success_total", M, "finish_reason"),
                        "{{finish_reason}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Request size (tokens)",
                "Median and p99 prompt and generation length per request: the workload mix the "
                "headroom figure was measured with should resemble this.",
                quantiles("ray_kvray_request_prompt_tokens", M, (0.5, 0.99), name="prompt")
                + quantiles(
                    "ray_kvray_request_generation_tokens", M, (0.5, 0.99), name="generation"
                ),
                width=12,
                extra_defaults={"custom": {"axisSoftMin": 0}},
            ),
            Panel(
                "Tokens per engine step",
                "Median and p99 tokens each engine step processes (prefill chunks plus one per "
                "decoding request): how full the batches are.",
                quantiles("ray_kvray_iteration_tokens", M, (0.5, 0.99)),
                width=12,
            ),
        ),
    ),
    Row(
        "Latency",
        (
            Panel(
                "Time to first token",
                "Arrival to first generated token, p50 / p90 / p99 per model. Includes queueing "
                "and prefill.",
                quantiles("ray_kvray_time_to_first_token_seconds", M, P3, by="model"),
                unit="s",
                width=6,
            ),
            Panel(
                "Inter-token latency",
                "Time between consecutive generated tokens, p50 / p90 / p99 per model.",
                quantiles("ray_kvray_inter_token_latency_seconds", M, P3, by="model"),
                unit="s",
                width=6,
            ),
            Panel(
                "End-to-end latency",
                "Arrival to finish, p50 / p90 / p99 per model.",
                quantiles("ray_kvray_e2e_request_latency_seconds", M, P3, by="model"),
                unit="s",
                width=6,
            ),
            Panel(
                "Queue time",
                "Arrival to first scheduled, p50 / p99 per model: time spent waiting for a "
                "batch slot or KV blocks.",
                quantiles("ray_kvray_request_queue_time_seconds", M, (0.5, 0.99), by="model"),
                unit="s",
                width=6,
            ),
        ),
    ),
    Row(
        "Saturation per replica",
        (
            Panel(
                "Running requests",
                "Requests in each replica's running batch.",
                (
                    Target(
                        f"max by (replica) (ray_kvray_num_requests_running{{{MR}}})", "{{replica}}"
                    ),
                ),
                width=6,
            ),
            Panel(
                "Waiting requests",
                "Requests queued in each replica, not yet scheduled. Persistently above 0 means "
                "the replica is saturated.",
                (
                    Target(
                        f"max by (replica) (ray_kvray_num_requests_waiting{{{MR}}})", "{{replica}}"
                    ),
                ),
                width=6,
            ),
            Panel(
                "KV cache usage",
                "Fraction of each replica's KV-cache blocks in use.",
                (
                    Target(
                        f"max by (replica) (ray_kvray_kv_cache_usage_ratio{{{MR}}})", "{{replica}}"
                    ),
                ),
                unit="percentunit",
                width=6,
                extra_defaults={"min": 0, "max": 1},
            ),
            Panel(
                "Preemptions/s",
                "Requests preempted per second per replica because KV blocks ran out; their "
                "work is recomputed later.",
                (Target(rate("ray_kvray_num_preemptions_total", MR, "replica"), "{{replica}}"),),
                width=6,
            ),
            Panel(
                "KV cache capacity (blocks)",
                "Total KV-cache blocks per replica, set by --kv-cache-memory and the model's "
                "shape.",
                (Target(f"max by (replica) (ray_kvray_kv_cache_blocks{{{MR}}})", "{{replica}}"),),
                width=24,
                height=6,
            ),
        ),
    ),
    Row(
        "Prefix cache",
        (
            Panel(
                "Prefix-cache hit ratio",
                "Share of looked-up prompt tokens found in each replica's prefix cache. The "
                "prefix-affinity router raises it for shared-prefix traffic.",
                (
                    Target(
                        f"{rate('ray_kvray_prefix_cache_hits_total', MR, 'replica')}"
                        f" / {rate('ray_kvray_prefix_cache_queries_total', MR, 'replica')}",
                        "{{replica}}",
                    ),
                ),
                unit="percentunit",
                extra_defaults={"min": 0, "max": 1},
            ),
            Panel(
                "Prefix-cache tokens/s",
                "Prompt tokens looked up and found in the prefix cache per second, all replicas.",
                (
                    Target(rate("ray_kvray_prefix_cache_queries_total", M), "looked up"),
                    Target(rate("ray_kvray_prefix_cache_hits_total", M), "hit"),
                ),
            ),
            Panel(
                "Routing decisions",
                "Router choices per second: affinity (prefix-preferred replica), load "
                "(least loaded), fallback (preferred replica saturated).",
                (Target(rate("ray_kvray_router_routing_total", by="decision"), "{{decision}}"),),
                unit="reqps",
            ),
        ),
    ),
    Row(
        "Errors and rejections",
        (
            Panel(
                "Non-OK responses",
                "Answers other than 2xx / OK per second by protocol and code: 4xx are client "
                "errors, 429 / RESOURCE_EXHAUSTED admission control, 5xx server errors.",
                (
                    Target(
                        rate(
                            "ray_kvray_router_requests_total",
                            f'code!~"{OK_CODES}"',
                            "protocol, code",
                        )
                        # A flat 0 labelled "none" while every answer was OK.
                        + ' or label_replace(vector(0), "code", "none", "", "")',
                        "{{protocol}} {{code}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Rejected and failed ratio",
                "Share of requests rejected as overloaded (429 / RESOURCE_EXHAUSTED) and failed "
                "with a server error. The alert rules fire above 5% and 1%.",
                (
                    Target(code_ratio(REJECTED_CODES), "rejected (429)"),
                    Target(code_ratio(SERVER_ERROR_CODES), "server error (5xx)"),
                ),
                unit="percentunit",
            ),
            Panel(
                "Rejections by reason",
                "Requests turned away before reaching an engine, by reason (e.g. the bounded "
                "waiting queue is full).",
                (Target(rate("ray_kvray_router_rejected_total", by="reason"), "{{reason}}"),),
                unit="reqps",
            ),
        ),
    ),
    Row(
        "Capacity and headroom",
        (
            Panel(
                "Utilisation",
                "Current output tokens/s over what the running engine replicas sustain at peak "
                "(the 'Peak output tokens/s per replica' variable, measured with "
                "`kvray bench serve`).",
                (Target(f"{GEN_RATE} / ({ENGINE_REPLICAS} * $peak_tokens_per_replica)"),),
                unit="percentunit",
                kind="stat",
                width=6,
                height=5,
                extra_defaults={
                    "thresholds": {
                        "mode": "absolute",
                        "steps": [
                            {"color": "green", "value": None},
                            {"color": "orange", "value": 0.7},
                            {"color": "red", "value": 0.9},
                        ],
                    }
                },
            ),
            Panel(
                "Replicas needed now",
                "Replicas the current output token rate needs at the measured peak per replica.",
                (Target(f"ceil({GEN_RATE} / $peak_tokens_per_replica)"),),
                kind="stat",
                width=6,
                height=5,
            ),
            Panel(
                "Replicas needed for target",
                "Replicas the 'Target load' variable (output tokens/s) needs at the measured peak "
                "per replica.",
                (Target("ceil(vector($target_tokens_per_s / $peak_tokens_per_replica))"),),
                kind="stat",
                width=6,
                height=5,
            ),
            Panel(
                "Replicas to add for target",
                "Replicas needed for the target load minus the engine replicas running now "
                "(0 when there is enough).",
                (
                    Target(
                        "clamp_min(ceil(vector($target_tokens_per_s / $peak_tokens_per_replica))"
                        f" - scalar({ENGINE_REPLICAS}), 0)"
                    ),
                ),
                kind="stat",
                width=6,
                height=5,
            ),
            Panel(
                "Output tokens/s per replica vs peak",
                "Each replica's output token rate against its measured peak: the gap is the "
                "headroom left on that replica.",
                (
                    Target(rate("ray_kvray_generation_tokens_total", MR, "replica"), "{{replica}}"),
                    Target("vector($peak_tokens_per_replica)", "peak per replica"),
                ),
                width=12,
            ),
            Panel(
                "Replica count",
                "Engine replicas reporting metrics against Ray Serve's healthy and target "
                "replica counts for the LLM deployment.",
                (
                    Target(ENGINE_REPLICAS, "engine replicas reporting"),
                    Target(f"sum(ray_serve_deployment_replica_healthy{{{SERVE}}})", "healthy"),
                    Target(f"max(ray_serve_autoscaling_target_replicas{{{SERVE}}})", "target"),
                ),
                width=12,
                extra_defaults={"decimals": 0},
            ),
        ),
    ),
)


def _variables() -> list[dict]:
    def query_var(name: str, label: str, query: str) -> dict:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "query": {"query": query, "refId": f"{name}-values"},
            "definition": query,
            "refresh": 2,  # on time-range change: replicas come and go
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
            "hide": 0,
            "options": [],
        }

    def textbox(name: str, label: str, value: str, description: str) -> dict:
        return {
            "name": name,
            "label": label,
            "type": "textbox",
            "query": value,
            "current": {"selected": False, "text": value, "value": value},
            "description": description,
            "hide": 0,
            "options": [{"selected": True, "text": value, "value": value}],
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "regex": "",
            "options": [],
        },
        query_var("model", "Model", "label_values(ray_kvray_kv_cache_blocks, model)"),
        query_var(
            "replica",
            "Replica",
            'label_values(ray_kvray_kv_cache_blocks{model=~"$model"}, replica)',
        ),
        textbox(
            "peak_tokens_per_replica",
            "Peak output tokens/s per replica",
            "500",
            "Sustainable output token throughput of ONE replica, measured with `kvray bench "
            "serve` (its 'Output token throughput') on a representative workload at the highest "
            "load that still met your latency SLO, divided by the replica count it ran against.",
        ),
        textbox(
            "target_tokens_per_s",
            "Target load (output tokens/s)",
            "2000",
            "The load to plan for, in output tokens/s across all replicas.",
        ),
        textbox(
            "serve_deployment",
            "Serve deployment",
            "LLMServer",
            "Ray Serve deployment name of the engine replicas (for Ray Serve's replica metrics).",
        ),
    ]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    targets = [
        {"refId": chr(ord("A") + i), "datasource": DS, "expr": t.expr, "legendFormat": t.legend}
        for i, t in enumerate(panel.targets)
    ]
    defaults: dict = {"unit": panel.unit, **panel.extra_defaults}
    if panel.kind == "stat":
        options: dict = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    else:
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
    }


def build() -> dict:
    """The dashboard as a dict; panels flow left to right and wrap at Grafana's 24 columns."""
    panels: list[dict] = []
    next_id = 1
    y = 0
    for row in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x = 0
        line_height = 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, line_height = 0, y + line_height, 0
            panels.append(_panel_json(panel, next_id, x, y))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "title": "kvray capacity",
        "uid": "kvray-capacity",
        "description": "Load, latency, saturation, prefix-cache effect, errors and headroom of "
        "kvray's engine replicas (metrics from Ray's metrics export port).",
        "tags": ["kvray", "llm", "ray"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": _variables()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
