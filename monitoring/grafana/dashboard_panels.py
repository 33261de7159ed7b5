"""The dashboard's building blocks: panels and their targets, and the PromQL they share.

Every row module (dashboard_traffic_rows, dashboard_replica_rows) builds its queries from these
selectors and helpers, so that sibling panels use the same label filters, rate interval and
quantile naming. Plain data: build_dashboard.py turns them into grafana-foundation-sdk panels.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    soft_min: float | None = None  # the y axis starts here unless the data goes lower
    # Colour steps of a stat panel: (colour, from value); the first step's value is None.
    thresholds: tuple[tuple[str, float | None], ...] = ()


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


# Shared by the overview and the capacity rows: they must count the same replicas.
ENGINE_REPLICAS = f"count(ray_kvray_kv_cache_blocks{{{M}}})"
GEN_RATE = rate("ray_kvray_generation_tokens_total", M)
# The signals LLMServer's autoscaling policy scales on (cluster/controller/autoscaling.py), summed
# over replicas, and the replicas they need at the policy's per-replica targets (dashboard
# variables): the same as the recording rule model:kvray_replicas_needed:ceil.
WAITING_SUM = f"sum(max by (replica) (ray_kvray_num_requests_waiting{{{M}}}))"
KV_USAGE_SUM = f"sum(max by (replica) (ray_kvray_kv_cache_usage_ratio{{{M}}}))"
WAITING_NEED = f"{WAITING_SUM} / $target_waiting_requests"
KV_NEED = f"{KV_USAGE_SUM} / $target_kv_cache_usage"
# `a > b or b`: the larger of the two; `or vector(0)`: no engine running (scaled to zero).
REPLICAS_NEEDED = f"ceil({WAITING_NEED} > {KV_NEED} or {KV_NEED}) or vector(0)"
