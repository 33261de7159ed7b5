"""helm/kvray renders, for the default values and every example values file, into objects that
Kubernetes, the KubeRay CRD, Ray Serve and kvray's own ServeConfig all accept."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.helm.helpers import (
    CRD_DIR,
    NAMESPACE,
    VALUE_SETS,
    of_kind,
    only,
    pod_templates,
    serve_config,
)
from tests.helm.schemas import crd_validator, validate_k8s, validate_pod_template

# Kinds Kubernetes does not define; each is checked against its own schema or by the tests
# in test_monitoring.py.
CUSTOM_KINDS = {
    ("ray.io/v1", "RayService"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    # Inference gateways (test_render_gateway.py).
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def case(request, chart, render) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(merged values, rendered objects) for one value set."""
    user_values = VALUE_SETS[request.param]
    return chart.merge_values(user_values), render(user_values)


def _ray_containers(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: t["spec"]["containers"][0] for name, t in pod_templates(rayservice).items()}


def test_builtin_objects_match_kubernetes_schemas(case):
    _, objects = case
    checked = 0
    for obj in objects:
        assert DNS_LABEL.match(obj["metadata"]["name"]), obj["metadata"]["name"]
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        validate_k8s(obj)
        checked += 1
    assert checked >= 1  # at least the Service


def test_rayservice_matches_kuberay_crd(case):
    crd = CRD_DIR / "ray.io_rayservices.yaml"
    if not crd.is_file():
        pytest.skip(f"KubeRay CRD not found at {crd} (CI provides ../shared/schemas)")
    _, objects = case
    rayservice = only(objects, "RayService")
    crd_validator(crd).validate(rayservice)


def test_pod_templates_match_kubernetes_schemas(case):
    _, objects = case
    for template in pod_templates(only(objects, "RayService")).values():
        validate_pod_template(template)


def test_serve_config_is_accepted_by_ray_serve_and_kvray(case):
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ServeConfig

    values, objects = case
    raw = serve_config(only(objects, "RayService"))
    parsed = ServeDeploySchema.model_validate(raw)
    # Serve's schema tolerates unknown keys for forward compatibility; a typo must not pass.
    assert set(raw) <= set(ServeDeploySchema.model_fields)
    assert set(raw["http_options"]) <= set(type(parsed.http_options).model_fields)
    assert set(raw["grpc_options"]) <= set(type(parsed.grpc_options).model_fields)
    app, liveness = parsed.applications
    assert app.import_path == "cluster.app:build_app"
    assert app.route_prefix == "/"
    # The pods' liveness probe path, served off the ingress (cluster/deploy/liveness.py).
    assert liveness.import_path == "cluster.app:build_liveness_app"
    assert liveness.route_prefix == values["probes"]["liveness"]["path"] == "/health"
    assert liveness.name == f"{app.name}-liveness"
    assert parsed.http_options.port == values["serve"]["httpPort"]
    assert parsed.grpc_options.port == values["serve"]["grpcPort"]
    # kvray's gRPC ingress binds the port itself; Serve's gRPC proxy must stay off it.
    assert parsed.grpc_options.grpc_servicer_functions == []

    config = ServeConfig.from_args(app.args)
    engine, serve = values["engine"], values["serve"]
    assert config.engine.tensor_parallel_size == engine["tensorParallelSize"]
    assert config.engine.device == engine["device"]
    assert config.limits.max_queued_requests == serve["maxQueuedRequests"]
    assert config.limits.max_queued_tokens == serve["maxQueuedTokens"]
    assert config.network.api_key_env == values["apiKey"]["envName"]
    assert config.engine.model == (values["model"]["path"] or None)
    if serve["autoscaling"]["enabled"]:
        assert config.autoscaling.enabled
        assert config.autoscaling.min_replicas == serve["autoscaling"]["minReplicas"]
        assert config.autoscaling.max_replicas == serve["autoscaling"]["maxReplicas"]
        scaling = serve["autoscaling"]
        assert config.autoscaling.autoscaling_policy == scaling["policy"]
        assert config.autoscaling.target_waiting_requests == scaling["targetWaitingRequests"]
        assert config.autoscaling.target_kv_cache_usage == scaling["targetKvCacheUsage"]
        assert config.autoscaling.upscale_delay_s == scaling["upscaleDelaySeconds"]
        assert config.autoscaling.downscale_delay_s == scaling["downscaleDelaySeconds"]
    else:
        assert not config.autoscaling.enabled
        assert config.replicas.num_replicas == serve["replicas"]


def test_one_engine_replica_fills_one_worker_pod(case):
    """GPUs per worker pod = tensorParallelSize, and the replica's placement group (from the
    application's own deployment options) fits a single pod, as STRICT_PACK requires."""
    from cluster.config import ServeConfig
    from cluster.deploy.app import llm_server_options

    values, objects = case
    rayservice = only(objects, "RayService")
    app = serve_config(rayservice)["applications"][0]
    options = llm_server_options(ServeConfig.from_args(app["args"]))
    bundles = options["placement_group_bundles"]
    assert options["placement_group_strategy"] == "STRICT_PACK"

    tp = values["engine"]["tensorParallelSize"]
    gpu_name = values["worker"]["gpuResourceName"]
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    pod_gpus = resources["limits"].get(gpu_name, 0)
    assert pod_gpus == sum(b.get("GPU", 0) for b in bundles)
    if values["engine"]["device"] == "cuda":
        assert pod_gpus == resources["requests"][gpu_name] == tp
    else:
        assert gpu_name not in resources["limits"] and gpu_name not in resources["requests"]
    assert _cpus(resources["limits"]["cpu"]) >= sum(b.get("CPU", 0) for b in bundles)


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_head_does_no_engine_work_and_each_pod_fits_one_replica(case):
    values, objects = case
    cluster = only(objects, "RayService")["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    # One CPU per TP rank advertised to Ray: a second replica's placement group cannot fit.
    assert group["rayStartParams"]["num-cpus"] == str(values["engine"]["tensorParallelSize"])
    limits = head["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    assert values["worker"]["gpuResourceName"] not in limits


def test_pod_labels_leave_kuberays_own_alone(case):
    """KubeRay labels Ray pods app.kubernetes.io/name=kuberay (plus created-by and ray.io/*) and
    its head Service selects on them; a template label overriding one cuts workers off."""
    _, objects = case
    for name, template in pod_templates(only(objects, "RayService")).items():
        for label in template["metadata"]["labels"]:
            assert not label.startswith("ray.io/"), (name, label)
            assert label not in {"app.kubernetes.io/name", "app.kubernetes.io/created-by"}, name


def test_worker_pods_follow_serve_replicas(case):
    values, objects = case
    cluster = only(objects, "RayService")["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    autoscaling = values["serve"]["autoscaling"]
    assert cluster["enableInTreeAutoscaling"] is autoscaling["enabled"]
    if autoscaling["enabled"]:
        bounds = (autoscaling["minReplicas"], autoscaling["maxReplicas"])
        assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] >= 0
    else:
        bounds = (values["serve"]["replicas"],) * 2
    # Prefill replicas (a fixed count) have engine pods of their own.
    pd = values["serve"]["disaggregation"]
    lo = pd["prefillReplicas"]
    hi = pd["prefillMaxReplicas"] if lo and pd["prefillMaxReplicas"] is not None else lo
    bounds = (bounds[0] + lo, bounds[1] + hi)
    assert (group["minReplicas"], group["maxReplicas"]) == bounds
    assert group["replicas"] == bounds[0]


def test_ports_and_services(case):
    values, objects = case
    rayservice = only(objects, "RayService")
    serve = values["serve"]
    metrics_port = values["ray"]["metricsPort"]
    for name, container in _ray_containers(rayservice).items():
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["serve"] == serve["httpPort"], name  # KubeRay's serve Service uses it
        assert ports["metrics"] == metrics_port, name
        # The gRPC ingress listens on the head only.
        assert ports.get("grpc") == (serve["grpcPort"] if name == "head" else None), name
    cluster = rayservice["spec"]["rayClusterConfig"]
    for params in [cluster["headGroupSpec"]["rayStartParams"]] + [
        g["rayStartParams"] for g in cluster["workerGroupSpecs"]
    ]:
        assert params["metrics-export-port"] == str(metrics_port)

    services = {s["metadata"]["name"].rsplit("-", 1)[1]: s for s in of_kind(objects, "Service")}
    assert set(services) == {"http", "grpc"}
    templates = pod_templates(rayservice)
    for kind, port, extra_selector in [
        ("http", serve["httpPort"], {"ray.io/serve": "true"}),  # proxies KubeRay found healthy
        ("grpc", serve["grpcPort"], {"ray.io/node-type": "head"}),  # KubeRay's head label
    ]:
        (service_port,) = services[kind]["spec"]["ports"]
        assert (service_port["name"], service_port["port"]) == (kind, port)
        assert service_port["targetPort"] == ("serve" if kind == "http" else "grpc")
        selector = dict(services[kind]["spec"]["selector"])
        for key, value in extra_selector.items():
            assert selector.pop(key) == value
        for name, template in templates.items():
            if kind == "grpc" and name != "head":
                continue
            assert selector.items() <= template["metadata"]["labels"].items(), (kind, name)


def test_probes_on_engine_pods_only(case):
    values, objects = case
    containers = _ray_containers(only(objects, "RayService"))
    head = containers.pop("head")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        # KubeRay deploys the application only once the head is Ready: its own GCS/raylet
        # probes must stay there.
        assert probe not in head
    for container in containers.values():
        for probe, path in [
            ("startupProbe", "/health"),
            ("livenessProbe", "/health"),
            ("readinessProbe", "/ready"),
        ]:
            assert container[probe]["httpGet"] == {"path": path, "port": "serve"}, probe
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading


def test_smoke_test_hook_targets_both_services(case):
    values, objects = case
    (pod,) = [o for o in of_kind(objects, "Pod")]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    http_url, grpc_target = container["command"][3:5]  # after `python -c SCRIPT`
    names = {s["metadata"]["name"] for s in of_kind(objects, "Service")}
    host, port = http_url.removeprefix("http://").split(":")
    assert host in names and int(port) == values["serve"]["httpPort"]
    host, port = grpc_target.split(":")
    assert host in names and int(port) == values["serve"]["grpcPort"]


def test_model_volume(case):
    values, objects = case
    volume = values["model"]["volume"]
    for name, template in pod_templates(only(objects, "RayService")).items():
        mounts = template["spec"]["containers"][0].get("volumeMounts", [])
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        if volume["type"] == "none":
            assert "model" not in volumes, name
            continue
        (mount,) = [m for m in mounts if m["name"] == "model"]
        assert mount["mountPath"] == volume["mountPath"] and mount["readOnly"] is True
        if volume["type"] == "pvc":
            claim = volumes["model"]["persistentVolumeClaim"]
            assert claim["claimName"] == volume["pvc"]["claimName"]
    if values["model"]["path"] and volume["type"] != "none":
        assert values["model"]["path"].startswith(volume["mountPath"].rstrip("/") + "/")


def test_api_key_reaches_pods_from_a_secret(case):
    values, objects = case
    key = values["apiKey"]
    rayservice = only(objects, "RayService")
    secret = key["existingSecret"] or (key["value"] and f"{rayservice['metadata']['name']}-api-key")
    for container in _ray_containers(rayservice).values():
        env = {e["name"]: e for e in container.get("env", [])}
        if not secret:
            assert key["envName"] not in env
            continue
        ref = env[key["envName"]]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (secret, key["secretKey"])


def test_pods_run_with_kvrays_serve_settings(case):
    """Every Ray container gets cluster/deploy/serve_env.py's settings, as `kvray serve` runs with;
    extraEnv comes after them, so a user's value for the same name wins."""
    from cluster.deploy.serve_env import SERVE_ENV

    _, objects = case
    for container in _ray_containers(only(objects, "RayService")).values():
        env = [(e["name"], e.get("value")) for e in container["env"]]
        assert env[: len(SERVE_ENV)] == list(SERVE_ENV.items())


def test_extra_env_overrides_a_serve_setting(render):
    extra = [{"name": "RAY_SERVE_USE_GRPC_BY_DEFAULT", "value": "0"}]
    for container in _ray_containers(only(render({"extraEnv": extra}), "RayService")).values():
        values = [e.get("value") for e in container["env"] if e["name"] == extra[0]["name"]]
        assert values[-1] == "0"  # Kubernetes applies the last of duplicate names


def test_chart_made_secret_keeps_the_key_out_of_the_serve_config(render):
    import base64

    objects = render({"apiKey": {"value": "s3cret-key"}})
    secret = only(objects, "Secret")
    assert base64.b64decode(secret["data"]["api-key"]) == b"s3cret-key"
    rayservice = only(objects, "RayService")
    assert "s3cret-key" not in rayservice["spec"]["serveConfigV2"]
    for container in _ray_containers(rayservice).values():
        (env,) = [e for e in container["env"] if e["name"] == "KVRAY_API_KEY"]
        assert env["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_namespace_is_the_release_namespace(case):
    _, objects = case
    for monitor in of_kind(objects, "PodMonitor"):
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]


TLS_VALUES = {"tls": {"enabled": True, "existingSecret": "kvray-tls"}}


@pytest.mark.parametrize(
    "values",
    [
        None,
        TLS_VALUES,
    ],
    ids=["plain", "tls"],
)
def test_serve_config_has_the_shape_kvray_config_writes(render, values):
    """`kvray config` is the reference Serve config; the chart's must agree on everything
    that is not a per-install value (gRPC options, import path, application name, ...)."""
    from cluster.cli.config import serve_config as kvray_config
    from cluster.config import ServeConfig

    chart = serve_config(only(render(values), "RayService"))
    chart_app = chart["applications"][0]
    http, grpc = chart["http_options"], chart["grpc_options"]
    reference = kvray_config(
        ServeConfig.from_args(chart_app["args"]), http["host"], http["port"], grpc["port"]
    )
    # args are per install (checked against ServeConfig above): each one the chart writes,
    # tls_cert_file / tls_key_file included, is what `kvray config` writes for that config.
    reference_app = reference["applications"][0]
    assert chart_app.pop("args").items() <= reference_app.pop("args").items()
    # Everything else must match.
    assert chart == reference


def test_migration_settings_reach_the_app_and_fit_the_pod_grace_period(render):
    """Requests of a stopped engine replica move after serve.gracefulShutdownTimeoutSeconds;
    Kubernetes must not kill its pod before that (worker.terminationGracePeriodSeconds)."""
    import helm_python

    app = serve_config(only(render(None), "RayService"))["applications"][0]
    assert app["args"]["max_migrations"] == 3
    assert app["args"]["graceful_shutdown_timeout_s"] == 30
    values = {"serve": {"gracefulShutdownTimeoutSeconds": 120}}
    with pytest.raises(helm_python.HelmError) as info:
        render(values)
    assert "terminationGracePeriodSeconds" in str(info.value)


def test_tracing_reaches_the_app_only_when_set(render):
    """serve.otlpEndpoint becomes the app's otlp_endpoint (with the sample ratio); unset,
    tracing is off and the args say nothing about it."""
    from cluster.config import ServeConfig

    args = serve_config(only(render(None), "RayService"))["applications"][0]["args"]
    assert "otlp_endpoint" not in args and "otlp_sample_ratio" not in args
    values = {"serve": {"otlpEndpoint": "http://otel-collector:4318", "otlpSampleRatio": 0.25}}
    args = serve_config(only(render(values), "RayService"))["applications"][0]["args"]
    config = ServeConfig.from_args(args)
    assert config.tracing.otlp_endpoint == "http://otel-collector:4318"
    assert config.tracing.otlp_sample_ratio == 0.25
