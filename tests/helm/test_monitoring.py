"""The chart's PrometheusRule and Grafana dashboard ConfigMap are built from the repository's
monitoring/ files (no copies that drift), and the PodMonitor scrapes Ray's metrics port."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.helpers import CHART_DIR, REPO_ROOT, only, parse_manifests, pod_templates

RULES_DIR = REPO_ROOT / "monitoring" / "prometheus" / "rules"
GRAFANA_DIR = REPO_ROOT / "monitoring" / "grafana"
ALL_ON = {
    "monitoring": {
        "podMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    }
}


@pytest.fixture(scope="module")
def objects(render):
    return render(ALL_ON)


@pytest.mark.parametrize(
    ("link", "target"), [("prometheus-rules", RULES_DIR), ("grafana", GRAFANA_DIR)]
)
def test_chart_files_are_links_into_monitoring(link, target):
    path = CHART_DIR / "files" / link
    assert path.is_symlink(), f"{path} must be a symlink to {target}, not a copy"
    assert path.resolve() == target.resolve()


def test_monitoring_is_off_by_default(render):
    kinds = {o["kind"] for o in render(None)}
    assert not kinds & {"PodMonitor", "PrometheusRule", "ConfigMap"}


def test_prometheus_rule_carries_every_rule_group(objects):
    expected = []
    for path in sorted(RULES_DIR.glob("*.y*ml")):
        expected.extend(yaml.safe_load(path.read_text())["groups"])
    assert expected, f"no rule files in {RULES_DIR}"
    rule = only(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == expected


def test_prometheus_rule_passes_promtool(objects, tmp_path: Path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (monitoring/install_prometheus.sh installs it)")
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(only(objects, "PrometheusRule")["spec"]))
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_config_map_for_the_grafana_sidecar(objects):
    dashboards = sorted(GRAFANA_DIR.glob("*.json"))
    assert dashboards, f"no dashboards in {GRAFANA_DIR}"
    config_map = only(objects, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(config_map["data"]) == [p.name for p in dashboards]
    for path in dashboards:
        assert json.loads(config_map["data"][path.name]) == json.loads(path.read_text())


def test_pod_monitor_scrapes_every_ray_pod(objects):
    monitor = only(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for name, template in pod_templates(only(objects, "RayService")).items():
        assert selector.items() <= template["metadata"]["labels"].items(), name
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert endpoint["port"] in ports, name


def test_packaged_chart_carries_the_monitoring_files(tmp_path: Path):
    """`helm package` follows the symlinks: the .tgz holds the rule files and dashboards
    themselves, so a chart installed from a repository renders the same objects."""
    import helm_python

    archive = helm_python.package(CHART_DIR, destination=tmp_path)
    with helm_python.Chart.load(archive) as packaged:
        names = {f["name"] for f in packaged.files}
        manifests = packaged.render(values=ALL_ON, name="kvray-test", namespace="llm")
    assert {f"files/grafana/{p.name}" for p in GRAFANA_DIR.glob("*.json")} <= names
    assert not any(name.endswith(".py") and "grafana" in name for name in names)
    rendered = parse_manifests(manifests)
    expected = []
    for path in sorted(RULES_DIR.glob("*.y*ml")):
        expected.extend(yaml.safe_load(path.read_text())["groups"])
    assert only(rendered, "PrometheusRule")["spec"]["groups"] == expected
