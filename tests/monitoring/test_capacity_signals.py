"""What the operator sees is what drives scaling: on the same replica load, the autoscaling
policy (cluster/controller/autoscaling.py), the recording rule model:kvray_replicas_needed:ceil
and the dashboard's "Replicas needed (autoscaler signals)" panel all ask for the same number
of replicas, at the same targets (ServeConfig's defaults). promtool evaluates the PromQL."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml

from cluster.config import ServeConfig
from cluster.controller.autoscaling import Load, ScalingTargets
from tests.monitoring.promkit import (
    DASHBOARD_VARIABLES,
    RULES_DIR,
    dashboard_queries,
    load_dashboard,
    run_promtool,
)

PANEL = "Replicas needed (autoscaler signals)"
RECORDING = RULES_DIR / "kvray-recording.yml"
# (waiting, KV usage) per replica of one model.
LOADS = {
    "idle": [(0, 0.0), (0, 0.0)],
    "queue": [(6, 0.3), (3, 0.2), (1, 0.1)],
    "kv_full": [(0, 0.95), (1, 0.9)],
    "both": [(9, 0.9), (8, 0.85)],
}


def _targets() -> ScalingTargets:
    cfg = ServeConfig()
    return ScalingTargets(
        target_waiting_requests=cfg.autoscaling.target_waiting_requests,
        target_kv_cache_usage=cfg.autoscaling.target_kv_cache_usage,
        upscale_delay_s=cfg.autoscaling.upscale_delay_s,
        downscale_delay_s=cfg.autoscaling.downscale_delay_s,
    )


def _rule_constant(record: str) -> float:
    for group in yaml.safe_load(RECORDING.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("record") == record:
                return float(rule["expr"].removeprefix("vector(").removesuffix(")"))
    raise AssertionError(f"no recording rule {record}")


def test_rule_and_dashboard_targets_are_the_autoscalers_defaults() -> None:
    cfg = ServeConfig()
    assert _rule_constant("kvray:autoscaling_target_waiting_requests") == (
        cfg.autoscaling.target_waiting_requests
    )
    assert (
        _rule_constant("kvray:autoscaling_target_kv_cache_usage")
        == cfg.autoscaling.target_kv_cache_usage
    )
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert (
        float(variables["target_waiting_requests"]["query"])
        == cfg.autoscaling.target_waiting_requests
    )
    assert (
        float(variables["target_kv_cache_usage"]["query"]) == cfg.autoscaling.target_kv_cache_usage
    )
    assert (
        float(DASHBOARD_VARIABLES["target_waiting_requests"])
        == cfg.autoscaling.target_waiting_requests
    )


@pytest.mark.parametrize("name", sorted(LOADS))
def test_policy_rule_and_panel_agree(name: str) -> None:
    replicas = LOADS[name]
    load = Load(waiting=sum(w for w, _ in replicas), kv_usage=sum(k for _, k in replicas))
    expected = _targets().replicas_for(load)
    (panel_expr,) = [expr for title, expr in dashboard_queries(load_dashboard()) if title == PANEL]
    series = []
    for i, (waiting, kv) in enumerate(replicas):
        labels = f'model="m", replica="r{i}", WorkerId="w{i}"'
        series.append(
            {"series": f"ray_kvray_num_requests_waiting{{{labels}}}", "values": f"{waiting}x10"}
        )
        series.append(
            {"series": f"ray_kvray_kv_cache_usage_ratio{{{labels}}}", "values": f"{kv}x10"}
        )
    with tempfile.TemporaryDirectory() as tmp:
        panel_rules = Path(tmp) / "panel.yml"
        panel_rules.write_text(
            yaml.safe_dump(
                {"groups": [{"name": "panel", "rules": [{"record": "panel", "expr": panel_expr}]}]}
            )
        )
        test = {
            "rule_files": [str(RECORDING), str(panel_rules)],
            "evaluation_interval": "15s",
            "tests": [
                {
                    "interval": "15s",
                    "input_series": series,
                    "promql_expr_test": [
                        {
                            "expr": "model:kvray_replicas_needed:ceil",
                            "eval_time": "1m",
                            "exp_samples": [
                                {
                                    "labels": 'model:kvray_replicas_needed:ceil{model="m"}',
                                    "value": expected,
                                }
                            ],
                        },
                        {
                            "expr": "panel",
                            "eval_time": "1m",
                            "exp_samples": [{"labels": "panel", "value": expected}],
                        },
                    ],
                }
            ],
        }
        path = Path(tmp) / "agree.test.yml"
        path.write_text(yaml.safe_dump(test))
        result = run_promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
