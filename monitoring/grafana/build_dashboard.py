"""Builds kvray's Grafana capacity dashboard: `python monitoring/grafana/build_dashboard.py`.

Writes monitoring/grafana/kvray-dashboard.json, the file Grafana imports and the Helm chart
ships; tests/monitoring/test_dashboard.py fails when the two drift apart. Standard library
only: a dashboard is plain JSON, and generating it keeps the PromQL of sibling panels
consistent (same selectors, same quantiles) where hand-editing 30 panels would not.

What the panels show is in dashboard_traffic_rows.py and dashboard_replica_rows.py, built
from dashboard_panels.py; this module adds the variables, lays the rows out on Grafana's grid
and writes the JSON. Metric names are the ones Ray's metrics exporter produces (DESIGN.md's
names with `ray_`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Siblings in this directory: on sys.path when run as a script (tests add it when importing).
from dashboard_panels import DS, Panel, Row
from dashboard_replica_rows import REPLICA_ROWS
from dashboard_traffic_rows import TRAFFIC_ROWS

OUTPUT = Path(__file__).with_name("kvray-dashboard.json")

ROWS: tuple[Row, ...] = TRAFFIC_ROWS + REPLICA_ROWS


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
