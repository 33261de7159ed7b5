"""Bad values fail at render (as `helm install` / `helm template` would) with an error that
names the offending key: values.schema.json for types and ranges, the templates' own checks
for rules across keys."""

from __future__ import annotations

import pytest

from tests.helm.helpers import VALUE_SETS


def _error(render, values) -> str:
    import helm_python

    with pytest.raises(helm_python.HelmError) as info:
        render(values)
    return str(info.value)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"engine": {"tensorParallelSize": 0}}, ["/engine/tensorParallelSize", "minimum"]),
        ({"serve": {"replicas": "two"}}, ["/serve/replicas", "want integer"]),
        ({"serve": {"autoscaling": {"maxReplicas": "8"}}}, ["/serve/autoscaling/maxReplicas"]),
        ({"engine": {"device": "tpu"}}, ["/engine/device"]),
        ({"engine": {"tensorParalelSize": 2}}, ["/engine", "tensorParalelSize"]),
        ({"model": {"volume": {"type": "pvc"}}}, ["/model/volume/pvc/claimName"]),
        ({"model": {"volume": {"type": "hostPath"}}}, ["/model/volume/hostPath/path"]),
        ({"head": {"rayStartParams": {"num-cpus": 2}}}, ["/head/rayStartParams/num-cpus"]),
        ({"serve": {"httpPort": 70000}}, ["/serve/httpPort"]),
        ({"serve": {"otlpEndpoint": "otel-collector:4318"}}, ["/serve/otlpEndpoint"]),
        ({"worker": {"resources": {"limits": {"cpu": "lots"}}}}, ["/worker/resources/limits/cpu"]),
        ({"head": {"labels": {"app.kubernetes.io/name": "x"}}}, ["/head/labels/app.kubernetes.io"]),
        ({"lora": {"maxLoras": 0}}, ["/lora/maxLoras", "minimum"]),
        ({"lora": {"modules": [{"name": "sql"}]}}, ["/lora/modules/0", "path"]),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_schema_rejects(render, values, expected):
    message = _error(render, values)
    assert "values don't meet the specifications of the schema" in message
    for fragment in expected:
        assert fragment in message, message


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            {"serve": {"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 2}}},
            "serve.autoscaling.maxReplicas (2) must be >= serve.autoscaling.minReplicas (4)",
        ),
        (
            {
                "engine": {"tensorParallelSize": 8},
                "worker": {"resources": {"limits": {"cpu": "4"}}},
            },
            "worker.resources.limits.cpu (4) must be >= engine.tensorParallelSize (8)",
        ),
        (
            {"model": {"initContainers": [{"name": "fetch", "image": "busybox"}]}},
            "model.initContainers need a volume to fill",
        ),
    ],
)
def test_templates_reject_inconsistent_values(render, values, expected):
    assert expected in _error(render, values)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_value_set_passes_the_schema(chart, name):
    chart.validate_schema(VALUE_SETS[name])  # raises HelmValuesError naming the key
