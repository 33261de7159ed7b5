"""The chart's Kubernetes inference gateway values (docs/deploy.md): an InferencePool of the
engine pods and an HTTPRoute to it, rendered only when asked for, and the engine replicas'
vLLM-named metrics port they rely on."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helm.helpers import (
    CRD_DIR,
    example_values,
    of_kind,
    only,
    pod_templates,
    serve_config,
)
from tests.helm.schemas import crd_validator

GATEWAY = example_values("gateway")
MINIMAL = {"gateway": {"enabled": True, "inferencePool": {"endpointPickerRef": {"name": "epp"}}}}
# The extension's CRDs, where CI keeps KubeRay's (offline here: the tests using them skip).
POOL_CRD = CRD_DIR / "inference.networking.k8s.io_inferencepools.yaml"
ROUTE_CRD = CRD_DIR / "gateway.networking.k8s.io_httproutes.yaml"


def _engine_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return pod_templates(only(objects, "RayService"))["engine"]["spec"]["containers"][0]


def test_nothing_renders_unless_enabled(render) -> None:
    objects = render(None)
    assert not of_kind(objects, "InferencePool") and not of_kind(objects, "HTTPRoute")
    policy = only(objects, "NetworkPolicy")
    assert 8001 not in [p["port"] for r in policy["spec"]["ingress"] for p in r.get("ports", [])]
    args = serve_config(only(objects, "RayService"))["applications"][0]["args"]
    assert "engine_metrics_port" not in args
    ports = {p["name"] for p in _engine_container(objects)["ports"]}
    assert "engine-metrics" not in ports


@pytest.mark.parametrize("values", [GATEWAY, MINIMAL], ids=["example", "minimal"])
def test_the_pool_selects_the_engine_pods_on_serves_port(render, values) -> None:
    objects = render(values)
    pool = only(objects, "InferencePool")
    templates = pod_templates(only(objects, "RayService"))
    selector = pool["spec"]["selector"]["matchLabels"]
    # Every engine pod and not the head (which runs no engine replica).
    assert selector.items() <= templates["engine"]["metadata"]["labels"].items()
    assert not selector.items() <= templates["head"]["metadata"]["labels"].items()
    http_port = serve_config(only(objects, "RayService"))["http_options"]["port"]
    assert pool["spec"]["targetPorts"] == [{"number": http_port}]
    serve_ports = {p["name"]: p["containerPort"] for p in _engine_container(objects)["ports"]}
    assert serve_ports["serve"] == http_port


@pytest.mark.parametrize("values", [GATEWAY, MINIMAL], ids=["example", "minimal"])
def test_the_engines_serve_their_metrics_on_a_container_port(render, values) -> None:
    from cluster.config import ServeConfig

    objects = render(values)
    port = (values["gateway"].get("engineMetricsPort")) or 8001  # the chart's default
    args = serve_config(only(objects, "RayService"))["applications"][0]["args"]
    assert ServeConfig.from_args(args).network.engine_metrics_port == port
    ports = {p["name"]: p["containerPort"] for p in _engine_container(objects)["ports"]}
    assert ports["engine-metrics"] == port
    head = pod_templates(only(objects, "RayService"))["head"]["spec"]["containers"][0]
    assert "engine-metrics" not in {p["name"] for p in head["ports"]}
    # The picker may scrape it through the release's NetworkPolicy.
    policy = only(objects, "NetworkPolicy")
    (rule,) = [
        r
        for r in policy["spec"]["ingress"]
        if {"port": port, "protocol": "TCP"} in r.get("ports", [])
    ]
    assert rule.get("from", []) == values["gateway"].get("metricsFrom", [{"namespaceSelector": {}}])
    no_policy = render({**values, "networkPolicy": {"enabled": False}})
    assert not of_kind(no_policy, "NetworkPolicy")


def test_the_route_sends_the_gateways_traffic_to_the_pool(render) -> None:
    objects = render(GATEWAY)
    pool, route = only(objects, "InferencePool"), only(objects, "HTTPRoute")
    assert route["spec"]["parentRefs"] == GATEWAY["gateway"]["httpRoute"]["parentRefs"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
    ]
    assert rule["timeouts"] == {"request": "600s"}
    # Off: the pool alone (the user's own route points at it).
    off = {**GATEWAY, "gateway": {**GATEWAY["gateway"], "httpRoute": {"enabled": False}}}
    assert not of_kind(render(off), "HTTPRoute") and of_kind(render(off), "InferencePool")


@pytest.mark.parametrize("values", [GATEWAY, MINIMAL], ids=["example", "minimal"])
def test_required_fields_of_the_api(render, values) -> None:
    """What the API reference requires (checked whatever CRDs are at hand)."""
    objects = render(values)
    pool, route = only(objects, "InferencePool"), only(objects, "HTTPRoute")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"]
    assert 1 <= len(spec["targetPorts"]) <= 8
    assert all(1 <= p["number"] <= 65535 for p in spec["targetPorts"])
    ref = spec["endpointPickerRef"]
    assert ref["name"] and 1 <= ref["port"]["number"] <= 65535  # kind Service needs a port
    assert ref["failureMode"] in ("FailClose", "FailOpen")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] and all(p["name"] for p in route["spec"]["parentRefs"])
    assert len(pool["metadata"]["name"]) <= 63 and len(route["metadata"]["name"]) <= 63


@pytest.mark.parametrize(
    ("crd", "kind"), [(POOL_CRD, "InferencePool"), (ROUTE_CRD, "HTTPRoute")], ids=["pool", "route"]
)
def test_objects_match_the_extensions_crds(render, crd, kind) -> None:
    if not crd.is_file():
        pytest.skip(
            f"{crd.name} not found in {CRD_DIR} (the Gateway API and inference extension CRDs "
            "are not available offline; put them beside KubeRay's to check)"
        )
    crd_validator(crd).validate(only(render(GATEWAY), kind))


def test_the_picker_is_required(render) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError, match="endpointPickerRef.name is required"):
        render({"gateway": {"enabled": True}})
    with pytest.raises(helm_python.HelmError, match="/gateway/inferencePool/endpointPickerRef"):
        render({"gateway": {"inferencePool": {"endpointPickerRef": {"failureMode": "Maybe"}}}})
