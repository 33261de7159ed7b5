"""tls.enabled: the kubernetes.io/tls Secret reaches the Ray container of every Ray pod (read-only),
Serve's proxies terminate HTTPS with it (http_options.ssl_*), the gRPC ingress serves TLS with
the same files (application args), HAProxy and direct ingress are off, probes and `helm test`
speak HTTPS. Off (the default), nothing of it is rendered. Every rendering is checked against
the Kubernetes and KubeRay schemas."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.helm.helpers import (
    CRD_DIR,
    VALUE_SETS,
    of_kind,
    only,
    pod_templates,
    serve_config,
)
from tests.helm.schemas import crd_validator, validate_k8s, validate_pod_template

SECRET = "kvray-tls"
TLS = {"tls": {"enabled": True, "existingSecret": SECRET}}
MOUNT = "/etc/kvray/tls"
CERT, KEY = f"{MOUNT}/tls.crt", f"{MOUNT}/tls.key"
HAPROXY_ENV = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY")
WITH_INIT = {
    "model": {
        "volume": {"type": "emptyDir"},
        "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
    }
}
CASES = {**VALUE_SETS, "init-containers": WITH_INIT}


def _merge(base: dict[str, Any] | None, extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base or {})
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _ray_containers(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: t["spec"]["containers"][0] for name, t in pod_templates(rayservice).items()}


def _env(container: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _validate(objects: list[dict[str, Any]]) -> None:
    """Every object against its schema, as the API server would check it."""
    rayservice = only(objects, "RayService")
    crd = CRD_DIR / "ray.io_rayservices.yaml"
    if crd.is_file():  # CI provides ../shared/schemas; test_render.py says so when it is absent
        crd_validator(crd).validate(rayservice)
    for template in pod_templates(rayservice).values():
        validate_pod_template(template)
    for obj in objects:
        if obj["apiVersion"] in ("v1", "networking.k8s.io/v1"):  # Service, Pod, Secret, ...
            validate_k8s(obj)


# ------------------------------------------------------------------------------- TLS off


@pytest.mark.parametrize("name", sorted(CASES))
def test_tls_off_renders_none_of_it(render, name):
    from cluster.deploy.serve_env import SERVE_ENV

    objects = render(CASES[name])
    rayservice = only(objects, "RayService")
    for group, template in pod_templates(rayservice).items():
        spec = template["spec"]
        assert "tls" not in {v["name"] for v in spec.get("volumes", [])}, group
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert "tls" not in {m["name"] for m in container.get("volumeMounts", [])}, group
    for name_, container in _ray_containers(rayservice).items():
        for key in HAPROXY_ENV:  # HAProxy in front of direct-ingress replicas
            assert _env(container)[key] == SERVE_ENV[key] == "1", name_
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert "scheme" not in container.get(probe, {}).get("httpGet", {}), (name_, probe)
    config = serve_config(rayservice)
    assert set(config["http_options"]) == {"host", "port"}
    app = config["applications"][0]
    assert not {"tls_cert_file", "tls_key_file"} & set(app["args"])
    (pod,) = of_kind(objects, "Pod")
    (container,) = pod["spec"]["containers"]
    assert container["command"][3].startswith("http://") and len(container["command"]) == 5
    assert "volumes" not in pod["spec"] and "volumeMounts" not in container
    protocols = {s["spec"]["ports"][0]["appProtocol"] for s in of_kind(objects, "Service")}
    assert protocols == {"http", "kubernetes.io/h2c"}


# -------------------------------------------------------------------------------- TLS on


@pytest.fixture(scope="module", params=sorted(CASES))
def tls_case(request, chart, render) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(merged values, rendered objects) for one value set with TLS on."""
    user_values = _merge(CASES[request.param], TLS)
    return chart.merge_values(user_values), render(user_values)


def test_tls_renders_valid_objects(tls_case):
    _, objects = tls_case
    _validate(objects)


def test_secret_is_mounted_read_only_in_every_ray_container(tls_case):
    values, objects = tls_case
    for group, template in pod_templates(only(objects, "RayService")).items():
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        # Readable by the pod's group (fsGroup 100 owns Secret volumes), not by others.
        assert volumes["tls"]["secret"] == {"secretName": SECRET, "defaultMode": 0o440}, group
        ray = spec["containers"][0]
        (mount,) = [m for m in ray["volumeMounts"] if m["name"] == "tls"]
        assert mount == {"name": "tls", "mountPath": MOUNT, "readOnly": True}, group
        # The model volume is still there when one is configured.
        has_model = any(m["name"] == "model" for m in ray["volumeMounts"])
        assert has_model is (values["model"]["volume"]["type"] != "none"), group
        # Init containers fetch checkpoints: they get no key.
        for init in spec.get("initContainers", []):
            assert "tls" not in {m["name"] for m in init["volumeMounts"]}, group


def test_without_fs_group_the_files_stay_readable_by_the_ray_user(render):
    objects = render({**TLS, "podSecurityContext": {"fsGroup": None}})  # null drops the default
    for template in pod_templates(only(objects, "RayService")).values():
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["defaultMode"] == 0o444  # root-owned files, uid 1000 reads
        validate_pod_template(template)


def test_serve_config_terminates_https_and_grpc_tls_with_the_secrets_files(tls_case):
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ServeConfig

    _, objects = tls_case
    raw = serve_config(only(objects, "RayService"))
    parsed = ServeDeploySchema.model_validate(raw)
    assert set(raw["http_options"]) <= set(type(parsed.http_options).model_fields)
    assert (parsed.http_options.ssl_certfile, parsed.http_options.ssl_keyfile) == (CERT, KEY)
    app = parsed.applications[0]
    config = ServeConfig.from_args(app.args)  # validates the pair
    assert config.network.tls
    assert (config.network.tls_cert_file, config.network.tls_key_file) == (CERT, KEY)


def test_haproxy_and_direct_ingress_are_off(tls_case):
    """The Ray containers run with what `kvray serve --tls-cert` sets for itself."""
    from cluster.deploy.serve_env import SERVE_ENV, apply_serve_env

    local: dict[str, str] = {}
    ports = iter(range(1, 100))
    apply_serve_env(local, free_port=lambda: next(ports), tls=True)
    expected = [(key, local[key]) for key in SERVE_ENV]
    assert [local[key] for key in HAPROXY_ENV] == ["0", "0"]
    _, objects = tls_case
    for name, container in _ray_containers(only(objects, "RayService")).items():
        env = [(e["name"], e.get("value")) for e in container["env"]]
        assert env[: len(SERVE_ENV)] == expected, name


def test_probes_speak_https(tls_case):
    _, objects = tls_case
    containers = _ray_containers(only(objects, "RayService"))
    head = containers.pop("head")
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(head)
    for container in containers.values():
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert (get["port"], get["scheme"]) == ("serve", "HTTPS"), probe


def test_network_policy_is_unchanged(render, tls_case):
    """TLS runs on the same ports: the policy admits exactly what it does without TLS."""
    values, objects = tls_case
    plain_values = {k: v for k, v in values.items() if k != "tls"}
    assert only(objects, "NetworkPolicy") == only(render(plain_values), "NetworkPolicy")


def test_services_declare_tls(tls_case):
    _, objects = tls_case
    for service in of_kind(objects, "Service"):
        (port,) = service["spec"]["ports"]
        assert port["appProtocol"] == "https", service["metadata"]["name"]


def test_smoke_test_uses_https_and_only_the_certificate(tls_case):
    values, objects = tls_case
    (pod,) = of_kind(objects, "Pod")
    (container,) = pod["spec"]["containers"]
    http_url, grpc_target, cert = container["command"][3:]
    assert http_url.startswith("https://") and http_url.endswith(f":{values['serve']['httpPort']}")
    assert grpc_target.endswith(f":{values['serve']['grpcPort']}")
    assert cert == CERT
    (mount,) = container["volumeMounts"]
    assert (mount["mountPath"], mount["readOnly"]) == (MOUNT, True)
    (volume,) = pod["spec"]["volumes"]
    # The certificate only: the private key stays out of the test pod.
    assert volume["secret"] == {
        "secretName": SECRET,
        "items": [{"key": "tls.crt", "path": "tls.crt"}],
    }


def test_notes_show_https(chart):
    from tests.helm.helpers import NAMESPACE, RELEASE

    def notes(values: dict[str, Any] | None) -> str:
        manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        (text,) = [t for path, t in manifests.items() if path.endswith("NOTES.txt")]
        return text

    with_tls = notes(TLS)
    assert "https://HOST:8000/v1/models" in with_tls and "http://" not in with_tls
    assert f"Secret {SECRET}" in with_tls
    assert "curl http://127.0.0.1:8000/v1/models" in notes(None)


@pytest.mark.parametrize("name", sorted(CASES))
def test_lint_is_clean_with_tls(name):
    import helm_python

    from tests.helm.helpers import CHART_DIR

    values = _merge(CASES[name], TLS)
    report = helm_python.lint(CHART_DIR, values, strict=True, namespace="llm")
    assert not report["errors"] and all(m["severity"] <= 1 for m in report["messages"]), report


# ---------------------------------------------------------------------------- bad values


def _error(render, values: dict[str, Any]) -> str:
    import helm_python

    with pytest.raises(helm_python.HelmError) as info:
        render(values)
    return str(info.value)


def test_tls_without_a_secret_is_a_clear_error(render):
    message = _error(render, {"tls": {"enabled": True}})
    assert "tls.enabled needs tls.existingSecret" in message
    assert "kubernetes.io/tls Secret (keys tls.crt and tls.key)" in message


def test_tls_needs_the_charts_probes(render):
    """Without them KubeRay adds a readiness probe that checks Serve's proxy over plain HTTP."""
    message = _error(render, {**TLS, "probes": {"enabled": False}})
    assert "tls.enabled needs probes.enabled" in message


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"tls": {"enabled": "yes"}}, "/tls/enabled"),
        ({"tls": {"enabled": True, "existingSecret": "Not_A_Name"}}, "/tls/existingSecret"),
        ({"tls": {"enabled": True, "secretName": SECRET}}, "secretName"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_schema_rejects_bad_tls_values(render, values, expected):
    message = _error(render, values)
    assert "values don't meet the specifications of the schema" in message
    assert expected in message, message
