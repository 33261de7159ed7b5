"""The Grafana dashboard: generated file is current, well formed, its PromQL parses, every
panel is described in monitoring/README.md."""

from __future__ import annotations

import importlib
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import yaml

from tests.monitoring.promkit import (
    DASHBOARD,
    KVRAY_METRICS,
    MONITORING,
    dashboard_queries,
    load_dashboard,
    referenced_metric_names,
    run_promtool,
)
from tests.monitoring.test_rules import SERVE_METRICS

HEADROOM_VARIABLES = {"peak_tokens_per_replica", "target_tokens_per_s"}


def _generator() -> ModuleType:
    """build_dashboard.py imported as `python monitoring/grafana/build_dashboard.py` runs it:
    with its directory first on sys.path, where its sibling modules are."""
    grafana = str(MONITORING / "grafana")
    sys.path.insert(0, grafana)
    try:
        return importlib.import_module("build_dashboard")
    finally:
        sys.path.remove(grafana)


def _panels() -> list[dict]:
    return [p for p in load_dashboard()["panels"] if p["type"] != "row"]


def test_json_is_what_the_generator_writes() -> None:
    assert DASHBOARD.read_text() == _generator().render(), (
        "stale dashboard: run `python monitoring/grafana/build_dashboard.py`"
    )


def test_datasource_is_a_variable_used_by_every_panel_and_target() -> None:
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_headroom_inputs_are_operator_set_variables() -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    for name in HEADROOM_VARIABLES:
        assert variables[name]["type"] == "textbox"
        assert float(variables[name]["query"]) > 0
    assert "kvray bench serve" in variables["peak_tokens_per_replica"]["description"]
    used = " ".join(expr for _, expr in dashboard_queries(load_dashboard(), {}))
    assert used  # substitution of every variable succeeded
    raw = " ".join(t["expr"] for p in _panels() for t in p["targets"])
    for name in HEADROOM_VARIABLES:
        assert f"${name}" in raw


def test_ids_are_unique_and_panels_do_not_overlap() -> None:
    panels = load_dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine


def test_every_panel_has_a_query_and_a_description() -> None:
    for panel in _panels():
        assert panel["targets"], panel["title"]
        assert len(panel["description"]) > 20, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_every_query_parses() -> None:
    """promtool parses PromQL when checking a rule file: one recording rule per target."""
    rules = [
        {"record": f"dashboard:target_{i}", "expr": expr}
        for i, (_, expr) in enumerate(dashboard_queries(load_dashboard()))
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dashboard.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_queries_use_only_exported_names_and_cover_every_kvray_metric() -> None:
    used = referenced_metric_names([e for _, e in dashboard_queries(load_dashboard())])
    known = SERVE_METRICS | {f"ray_{n}" for n in KVRAY_METRICS}
    known |= {f"ray_{n}_{s}" for n in KVRAY_METRICS for s in ("bucket", "count", "sum")}
    assert used <= known, used - known
    covered = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert {f"ray_{n}" for n in KVRAY_METRICS} <= covered


def test_dashboard_covers_the_capacity_topics() -> None:
    titles = {p["title"] for p in load_dashboard()["panels"] if p["type"] == "row"}
    assert titles == {
        "Overview",
        "Traffic",
        "Latency",
        "Saturation per replica",
        "Prefix cache",
        "Structured outputs",
        "Errors and rejections",
        "Capacity and headroom",
        "Tenants",
        "LoRA adapters",
        "Mixture of experts",
        "Prefill/decode disaggregation",
    }


def test_readme_describes_every_panel_and_variable() -> None:
    readme = (MONITORING / "README.md").read_text()
    for panel in load_dashboard()["panels"]:
        assert f"**{panel['title']}**" in readme or f"### {panel['title']}" in readme, panel[
            "title"
        ]
    for variable in load_dashboard()["templating"]["list"]:
        assert f"`{variable['name']}`" in readme, variable["name"]


def test_the_expected_metrics_table_is_the_documented_one() -> None:
    """monitoring/README.md's metrics table (names, types, labels) is what the tests expect
    (promkit.KVRAY_METRICS), name for name and type for type; the real scrape in
    tests/cluster/replica/test_metrics.py checks the code against it."""
    from tests.monitoring.promkit import documented_metrics

    assert {name: kind for name, (kind, _) in documented_metrics().items()} == KVRAY_METRICS
