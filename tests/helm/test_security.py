"""The chart is secure by default: Ray's token authentication on, a NetworkPolicy that keeps
Ray's control plane to the release's own Ray pods, a restrictive securityContext on every
container, the API key only in a Secret and only where it is read, the dashboard's address
a value. Rendered with the real Helm library and checked against the Kubernetes and KubeRay
schemas."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helm.helpers import CRD_DIR, NAMESPACE, RELEASE, VALUE_SETS, of_kind, only, pod_templates
from tests.helm.schemas import crd_validator, validate_k8s, validate_pod_template

# Ports Ray opens on the head for its own use; the Jobs API (dashboard) and Ray Client run
# arbitrary code, the GCS holds the cluster's state.
GCS_PORT, RAY_CLIENT_PORT = 6379, 10001
INIT_CONTAINER = {"name": "fetch", "image": "busybox", "command": ["true"]}
WITH_INIT = {"model": {"volume": {"type": "emptyDir"}, "initContainers": [INIT_CONTAINER]}}
# Value sets whose every pod and container is checked: the chart's own plus one with init
# containers (no example has them).
SECURITY_CASES = {**VALUE_SETS, "init-containers": WITH_INIT}


def _rayservice(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return only(objects, "RayService")


def _validate_rayservice(rayservice: dict[str, Any]) -> None:
    crd = CRD_DIR / "ray.io_rayservices.yaml"
    if crd.is_file():  # CI provides ../shared/schemas; test_render.py says so when it is absent
        crd_validator(crd).validate(rayservice)


# ---------------------------------------------------------------- Ray token authentication


def test_ray_token_auth_is_on_by_default(render):
    rayservice = _rayservice(render(None))
    _validate_rayservice(rayservice)
    # KubeRay generates the token Secret itself when no secretName is given.
    assert rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}


def test_ray_token_from_an_existing_secret(render):
    rayservice = _rayservice(render({"rayAuth": {"existingSecret": "ray-token"}}))
    _validate_rayservice(rayservice)
    auth = rayservice["spec"]["rayClusterConfig"]["authOptions"]
    assert auth == {"mode": "token", "secretName": "ray-token"}


def test_ray_token_auth_can_be_turned_off(render):
    rayservice = _rayservice(render({"rayAuth": {"enabled": False}}))
    _validate_rayservice(rayservice)
    assert "authOptions" not in rayservice["spec"]["rayClusterConfig"]


def test_ray_token_auth_needs_ray_2_52(render):
    import helm_python

    with pytest.raises(helm_python.HelmError) as info:
        render({"ray": {"version": "2.51.1"}})
    assert "rayAuth.enabled needs Ray >= 2.52.0 (ray.version is 2.51.1)" in str(info.value)
    # Without token authentication an older Ray renders.
    render({"ray": {"version": "2.51.1"}, "rayAuth": {"enabled": False}})


# ---------------------------------------------------------------------------- NetworkPolicy


def _rules(policy: dict[str, Any]) -> list[tuple[set[int] | None, list[dict[str, Any]] | None]]:
    """(ports, peers) per ingress rule; None: every port / every source."""
    rules = []
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]} if rule.get("ports") else None
        rules.append((ports, rule.get("from") or None))
    return rules


def _admitted(policy: dict[str, Any], port: int) -> list[list[dict[str, Any]] | None]:
    """The peer lists of every rule that opens `port` (None: a rule open to any source)."""
    return [peers for ports, peers in _rules(policy) if ports is None or port in ports]


def _release_pods() -> list[dict[str, Any]]:
    return [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/part-of": "kvray",
                    "app.kubernetes.io/instance": RELEASE,
                }
            }
        }
    ]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_network_policy_covers_every_ray_pod(chart, render, name):
    values = chart.merge_values(VALUE_SETS[name])
    objects = render(VALUE_SETS[name])
    policy = only(objects, "NetworkPolicy")
    validate_k8s(policy)
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress left open on purpose
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for group, template in pod_templates(_rayservice(objects)).items():
        assert selector.items() <= template["metadata"]["labels"].items(), group
    # The smoke test is a client, not a Ray pod: the policy must not select it.
    (smoke,) = of_kind(objects, "Pod")
    assert not selector.items() <= smoke["metadata"]["labels"].items()

    serve, ray = values["serve"], values["ray"]
    np = values["networkPolicy"]
    # Ray's control plane: only the release's own Ray pods.
    for port in (GCS_PORT, RAY_CLIENT_PORT):
        assert _admitted(policy, port) == [_release_pods()], port
    # The dashboard (Jobs API): Ray pods and the KubeRay operator.
    assert _admitted(policy, ray["dashboardPort"]) == [
        _release_pods(),
        np["kuberayOperator"]["from"],
    ]
    assert _admitted(policy, ray["metricsPort"]) == [_release_pods(), np["metrics"]["from"]]
    for port in (serve["httpPort"], serve["grpcPort"]):
        assert _admitted(policy, port) == [_release_pods(), np["api"]["from"]], port


def test_network_policy_defaults(render):
    policy = only(render(None), "NetworkPolicy")
    assert _admitted(policy, 8000) == [_release_pods(), [{"namespaceSelector": {}}]]
    (metrics,) = _admitted(policy, 8080)[1]
    assert metrics == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    (operator,) = _admitted(policy, 8265)[1]
    assert operator["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kuberay-system"
    }
    assert operator["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}


def test_network_policy_sources_are_configurable(render):
    cidr = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    prom = [{"namespaceSelector": {"matchLabels": {"name": "observability"}}}]
    extra = [{"ports": [{"port": 8265, "protocol": "TCP"}], "from": cidr}]
    values = {
        "networkPolicy": {
            "api": {"from": []},  # open to any source (a LoadBalancer in front)
            "metrics": {"from": prom},
            "extraIngress": extra,
        },
        "serve": {"httpPort": 8100, "grpcPort": 9100},
        "ray": {"metricsPort": 9090, "dashboardPort": 8266},
    }
    policy = only(render(values), "NetworkPolicy")
    validate_k8s(policy)
    assert _admitted(policy, 8100) == [_release_pods(), None]
    assert _admitted(policy, 9100) == [_release_pods(), None]
    assert _admitted(policy, 9090) == [_release_pods(), prom]
    assert _admitted(policy, 8266)[0] == _release_pods() and len(_admitted(policy, 8266)) == 2
    assert _admitted(policy, 8265) == [_release_pods(), cidr]  # the extra rule, as written
    assert _admitted(policy, 8000) == [_release_pods()]  # old port numbers are not left open
    assert _admitted(policy, GCS_PORT) == [_release_pods()]


def test_network_policy_can_be_turned_off(render):
    assert not of_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


# -------------------------------------------------------------------------- securityContext


def _rendered_pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod spec the chart renders: the RayService's templates and the smoke test."""
    specs = {name: t["spec"] for name, t in pod_templates(_rayservice(objects)).items()}
    for pod in of_kind(objects, "Pod"):
        specs[pod["metadata"]["name"]] = pod["spec"]
    return specs


def _assert_restricted(pod_spec: dict[str, Any], container: dict[str, Any], where: str) -> None:
    sc = container.get("securityContext") or {}
    pod_sc = pod_spec.get("securityContext") or {}
    assert sc.get("allowPrivilegeEscalation") is False, where
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
    assert sc.get("privileged") is not True, where
    run_as_non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    assert run_as_non_root is True, where
    # runAsNonRoot on an image whose USER is a name (the Ray image's "ray") needs a uid.
    assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) != 0, where
    seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile"))
    assert seccomp == {"type": "RuntimeDefault"}, where


@pytest.mark.parametrize("name", sorted(SECURITY_CASES))
def test_every_container_is_restricted(render, name):
    objects = render(SECURITY_CASES[name])
    rayservice = _rayservice(objects)
    _validate_rayservice(rayservice)
    checked = 0
    for pod_name, spec in _rendered_pods(objects).items():
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, pod_name
        assert spec["securityContext"]["runAsNonRoot"] is True, pod_name
        for container in spec.get("initContainers", []) + spec["containers"]:
            _assert_restricted(spec, container, f"{pod_name}/{container['name']}")
            checked += 1
    for template in pod_templates(rayservice).values():
        validate_pod_template(template)
    for pod in of_kind(objects, "Pod"):
        validate_k8s(pod)
    # KubeRay's autoscaler sidecar, added to the head when autoscaling is on.
    autoscaler = rayservice["spec"]["rayClusterConfig"].get("autoscalerOptions")
    if autoscaler is not None:
        _assert_restricted(_rendered_pods(objects)["head"], autoscaler, "autoscaler")
    init = name == "init-containers"
    assert checked == 3 + 2 * init  # head, engine, smoke test (+ an init container per Ray pod)


def test_init_containers_keep_their_own_security_settings(render):
    own = {"runAsUser": 2000, "readOnlyRootFilesystem": True}
    values = {**WITH_INIT, "model": {**WITH_INIT["model"]}}
    values["model"]["initContainers"] = [{**INIT_CONTAINER, "securityContext": own}]
    for template in pod_templates(_rayservice(render(values))).values():
        (init,) = template["spec"]["initContainers"]
        sc = init["securityContext"]
        assert sc["runAsUser"] == 2000 and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
        validate_pod_template(template)


# ------------------------------------------------------------------------------- the API key

KEY = "kvray-plaintext-canary-8d1f"


@pytest.mark.parametrize(
    "api_key", [{"value": KEY}, {"existingSecret": "my-key"}], ids=["chart-secret", "existing"]
)
def test_api_key_only_in_ray_containers_and_never_in_plain_text(chart, api_key):
    from tests.helm.helpers import parse_manifests

    values = {"apiKey": api_key, **WITH_INIT}
    manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    for path, text in manifests.items():  # NOTES.txt included
        assert KEY not in text, path
    objects = parse_manifests(manifests)
    rayservice = _rayservice(objects)
    secret_name = api_key.get("existingSecret") or f"{rayservice['metadata']['name']}-api-key"
    readers = []
    for pod_name, spec in _rendered_pods(objects).items():
        for container in spec.get("initContainers", []) + spec["containers"]:
            for env in container.get("env", []):
                if env["name"] == "KVRAY_API_KEY":
                    assert "value" not in env
                    assert env["valueFrom"]["secretKeyRef"]["name"] == secret_name
                    readers.append(f"{pod_name}/{container['name']}")
    # The ingresses read it: gRPC on the head, HTTP replicas on any Ray pod (they take no CPU
    # and have no placement constraint). Not the init containers, not the smoke test.
    assert sorted(readers) == ["engine/ray-worker", "head/ray-head"]
    assert "env" not in (rayservice["spec"]["rayClusterConfig"].get("autoscalerOptions") or {})


# -------------------------------------------------------------------------- dashboard-host


def test_dashboard_host_is_a_value(render):
    def host(values: dict[str, Any] | None) -> str:
        cluster = _rayservice(render(values))["spec"]["rayClusterConfig"]
        for group in cluster["workerGroupSpecs"]:
            assert "dashboard-host" not in group["rayStartParams"]
        return cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"]

    assert host(None) == "0.0.0.0"  # the KubeRay operator reaches it over the pod network
    assert host({"ray": {"dashboardHost": "127.0.0.1"}}) == "127.0.0.1"


# ------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"rayAuth": {"enabled": "yes"}}, "/rayAuth/enabled"),
        ({"networkPolicy": {"api": {"from": [{"podSelecter": {}}]}}}, "/networkPolicy/api/from/0"),
        ({"networkPolicy": {"metrics": {"from": [{}]}}}, "/networkPolicy/metrics/from/0"),
        ({"ray": {"dashboardHost": ""}}, "/ray/dashboardHost"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_schema_rejects_bad_security_values(render, values, expected):
    import helm_python

    with pytest.raises(helm_python.HelmError) as info:
        render(values)
    assert expected in str(info.value)
