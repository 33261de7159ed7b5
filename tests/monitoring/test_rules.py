"""The shipped Prometheus config and rules: promtool's syntax checks and unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.monitoring.promkit import (
    KVRAY_METRICS,
    MONITORING,
    RULES_DIR,
    referenced_metric_names,
    rule_expressions,
    run_promtool,
)

PROM_DIR = MONITORING / "prometheus"
RULE_FILES = sorted(RULES_DIR.glob("*.yml"))
UNIT_TESTS = sorted((PROM_DIR / "tests").glob("*.test.yml"))
# Ray Serve's own metrics the rules and dashboard use (names checked in a real scrape by
# test_prometheus_live.py).
SERVE_METRICS = {"ray_serve_deployment_replica_healthy", "ray_serve_autoscaling_target_replicas"}


def test_there_are_recording_and_alert_rules_with_unit_tests() -> None:
    assert {p.name for p in RULE_FILES} == {"kvray-recording.yml", "kvray-alerts.yml"}
    assert {p.name for p in UNIT_TESTS} == {
        "kvray-recording.test.yml",
        "kvray-alerts.test.yml",
    }


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path: Path) -> None:
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", UNIT_TESTS, ids=lambda p: p.name)
def test_promtool_test_rules(path: Path) -> None:
    result = run_promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config() -> None:
    result = run_promtool("check", "config", str(PROM_DIR / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_use_only_exported_names() -> None:
    """Rules read Ray's exporter's names (ray_ + monitoring/README.md's) or Ray Serve's."""
    known = SERVE_METRICS | {f"ray_{n}" for n in KVRAY_METRICS}
    known |= {f"ray_{n}_{s}" for n in KVRAY_METRICS for s in ("bucket", "count", "sum")}
    used = referenced_metric_names([expr for _, expr in rule_expressions()])
    assert used <= known, used - known


def test_every_alert_has_a_unit_test() -> None:
    import yaml

    alerts = {name for name, _ in rule_expressions() if name[0].isupper()}
    tested: set[str] = set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check["exp_alerts"]:  # a check that the alert does fire
                    tested.add(check["alertname"])
    assert alerts == tested
