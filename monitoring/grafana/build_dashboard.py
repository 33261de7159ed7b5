"""Builds kvray's Grafana capacity dashboard: `python monitoring/grafana/build_dashboard.py`.

Writes monitoring/grafana/kvray-dashboard.json, the file Grafana imports and the Helm chart
ships; tests/monitoring/test_dashboard.py fails when the two drift apart. The JSON comes from
Grafana's own dashboards-as-code SDK (`grafana-foundation-sdk`, the `dev` extra): typed
builders generated from Grafana's schema, so a misspelt option or a value of the wrong kind
fails here, not silently in Grafana.

What the panels show is in dashboard_traffic_rows.py, dashboard_replica_rows.py,
dashboard_tenant_rows.py, dashboard_lora_rows.py and dashboard_moe_rows.py, built from
dashboard_panels.py (plain data, so sibling panels share their PromQL); this module turns
them into SDK panels, adds the variables, lays the rows out on Grafana's grid and writes the
JSON. Metric names are the ones
Ray's metrics exporter produces (monitoring/README.md's, with `ray_`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Siblings in this directory: on sys.path when run as a script (tests add it when importing).
from dashboard_lora_rows import LORA_ROWS
from dashboard_moe_rows import MOE_ROWS
from dashboard_panels import DS, Panel, Row
from dashboard_replica_rows import REPLICA_ROWS
from dashboard_tenant_rows import TENANT_ROWS
from dashboard_traffic_rows import TRAFFIC_ROWS
from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as models

OUTPUT = Path(__file__).with_name("kvray-dashboard.json")
GRID_COLUMNS = 24

ROWS: tuple[Row, ...] = TRAFFIC_ROWS + REPLICA_ROWS + TENANT_ROWS + LORA_ROWS + MOE_ROWS
DATASOURCE = models.DataSourceRef(type_val=DS["type"], uid=DS["uid"])


def _variables() -> list[dashboard.QueryVariable | dashboard.TextBoxVariable]:
    def query_var(name: str, label: str, query: str) -> dashboard.QueryVariable:
        return (
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            # The query object of Prometheus's variable editor (a bare string is its legacy form).
            .query({"query": query, "refId": f"{name}-values"})
            # On time-range change: replicas come and go.
            .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .multi(True)
            .all_value(".*")
            .current(models.VariableOption(selected=True, text=["All"], value=["$__all"]))
            .sort(models.VariableSort.ALPHABETICAL_ASC)
        )

    def textbox(name: str, label: str, value: str, description: str) -> dashboard.TextBoxVariable:
        return (
            dashboard.TextBoxVariable(name)
            .label(label)
            .default_value(value)
            .current(models.VariableOption(selected=False, text=value, value=value))
            .description(description)
        )

    return [
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"),
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
            "target_waiting_requests",
            "Target waiting requests",
            "4",
            "The autoscaler's target of waiting requests per replica: the application's "
            "--target-waiting-requests (Helm: serve.autoscaling.targetWaitingRequests).",
        ),
        textbox(
            "target_kv_cache_usage",
            "Target KV-cache usage",
            "0.8",
            "The autoscaler's target KV-cache usage per replica (0-1): the application's "
            "--target-kv-cache-usage (Helm: serve.autoscaling.targetKvCacheUsage).",
        ),
        textbox(
            "serve_deployment",
            "Serve deployment",
            "LLMServer",
            "Ray Serve deployment name of the engine replicas (for Ray Serve's replica metrics).",
        ),
    ]


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> stat.Panel | timeseries.Panel:
    builder: stat.Panel | timeseries.Panel
    if panel.kind == "stat":
        builder = (
            stat.Panel()
            .reduce_options(
                common.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)
            )
            .color_mode(common_models.BigValueColorMode.VALUE)
            .graph_mode(common_models.BigValueGraphMode.AREA)
            .text_mode(common_models.BigValueTextMode.AUTO)
        )
    elif panel.kind == "timeseries":
        builder = (
            timeseries.Panel()
            .legend(
                common.VizLegendOptions()
                .display_mode(common_models.LegendDisplayMode.LIST)
                .placement(common_models.LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(
                common.VizTooltipOptions()
                .mode(common_models.TooltipDisplayMode.MULTI)
                .sort(common_models.SortOrder.DESCENDING)
            )
        )
        if panel.soft_min is not None:
            builder = builder.axis_soft_min(panel.soft_min)
    else:
        raise ValueError(f"{panel.title}: unknown panel kind {panel.kind!r}")
    builder = (
        builder.id(panel_id)
        .title(panel.title)
        .description(panel.description)
        .datasource(DATASOURCE)
        .grid_pos(models.GridPos(h=panel.height, w=panel.width, x=x, y=y))
        .unit(panel.unit)
    )
    for i, target in enumerate(panel.targets):
        builder = builder.with_target(
            prometheus.Dataquery()
            .ref_id(chr(ord("A") + i))
            .datasource(DATASOURCE)
            .expr(target.expr)
            .legend_format(target.legend)
        )
    if panel.min is not None:
        builder = builder.min(panel.min)
    if panel.max is not None:
        builder = builder.max(panel.max)
    if panel.decimals is not None:
        builder = builder.decimals(panel.decimals)
    if panel.thresholds:
        steps = [models.Threshold(color=c, value=v) for c, v in panel.thresholds]
        builder = builder.thresholds(
            dashboard.ThresholdsConfig().mode(models.ThresholdsMode.ABSOLUTE).steps(steps)
        )
    return builder


def build() -> dashboard.Dashboard:
    """The dashboard builder; panels flow left to right and wrap at Grafana's 24 columns.

    Positions are set here, not left to the SDK's cursor: that one wraps only after a panel
    has overflowed the line."""
    board = (
        dashboard.Dashboard("kvray capacity")
        .uid("kvray-capacity")
        .description(
            "Load, latency, saturation, prefix-cache effect, errors and headroom of kvray's "
            "engine replicas (metrics from Ray's metrics export port)."
        )
        .tags(["kvray", "llm", "ray"])
        .timezone("browser")
        .editable()
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-1h", "now")
        .version(1)
    )
    for variable in _variables():
        board = board.with_variable(variable)
    next_id = 1
    y = 0
    for row in ROWS:
        board = board.with_row(
            dashboard.Row(row.title)
            .id(next_id)
            .grid_pos(models.GridPos(h=1, w=GRID_COLUMNS, x=0, y=y))
        )
        next_id += 1
        y += 1
        x = 0
        line_height = 0
        for panel in row.panels:
            if x + panel.width > GRID_COLUMNS:
                x, y, line_height = 0, y + line_height, 0
            board = board.with_panel(_panel(panel, next_id, x, y))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return board


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=False) + "\n"


def main() -> int:
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
