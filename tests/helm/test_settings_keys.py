"""The chart's values and its Serve config template map onto the settings ServeConfig
declares (cluster/config/): every `args` key the template writes is a setting, and every
engine and serve value is one, with the same default, unless listed here with its reason."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from cluster.config import ServeConfig

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvray"
# Chart value -> setting, where the name is not the setting's in camelCase.
RENAMED = {
    "replicas": "num_replicas",
    "gracefulShutdownTimeoutSeconds": "graceful_shutdown_timeout_s",
    "mode": "pd",  # serve.disaggregation.mode
}
# Chart values that are not settings of the application (where Serve listens, its name) or
# whose default differs on purpose.
NOT_SETTINGS = {"httpPort", "grpcPort", "appName", "autoscaling"}
CHART_DEFAULTS = {"device": "cuda"}  # the chart runs on GPU nodes


def _declared() -> dict[str, object]:
    return {f.name: f.default for _, f, _ in ServeConfig.settings()}


def _snake(name: str) -> str:
    return RENAMED.get(name) or re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_every_args_key_the_template_writes_is_a_setting() -> None:
    text = (CHART / "templates" / "_serveconfig.tpl").read_text()
    literal = re.search(r"\$args := dict(.*?)\}\}", text, re.S)
    assert literal is not None
    keys = set(re.findall(r'^\s*"([a-z_]+)"', literal.group(1), re.M))
    keys |= set(re.findall(r'set \$args "([a-z_]+)"', text))
    assert len(keys) > 20
    assert keys - set(_declared()) == set()


def test_engine_and_serve_values_are_settings_with_their_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    declared = _declared()
    serve = dict(values["serve"])
    group = serve.pop("disaggregation")  # a group of settings
    chart = {**values["engine"], **serve, **group}
    for name, value in chart.items():
        if name in NOT_SETTINGS:
            continue
        key = _snake(name)
        assert key in declared, f"{name}: no setting {key}"
        # An empty string is how a chart leaves an optional value unset.
        default = CHART_DEFAULTS.get(name, declared[key])
        assert (None if value == "" else value) == default, name
