"""apiKeysFile: the Secret holding an API-keys file reaches the Ray container of every Ray pod,
read-only, and the application's api_keys_file names the mounted file; off (the default),
nothing of it is rendered. Renderings are checked against the Kubernetes schemas."""

from __future__ import annotations

import pytest

from tests.helm.helpers import VALUE_SETS, only, pod_templates, serve_config
from tests.helm.schemas import validate_pod_template

SECRET = "kvray-api-keys"
MOUNT = "/etc/kvray/api-keys"
KEYS = {"apiKeysFile": {"existingSecret": SECRET}}


def _app_args(objects: list[dict]) -> dict:
    return serve_config(only(objects, "RayService"))["applications"][0]["args"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_off_by_default(render, name):
    objects = render(VALUE_SETS[name])
    assert "api_keys_file" not in _app_args(objects)
    for template in pod_templates(only(objects, "RayService")).values():
        spec = template["spec"]
        assert "api-keys" not in {v["name"] for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            assert "api-keys" not in {m["name"] for m in container.get("volumeMounts", [])}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_the_secret_is_mounted_read_only_in_every_ray_container(render, name):
    values = {**(VALUE_SETS[name] or {}), **KEYS}
    objects = render(values)
    for group, template in pod_templates(only(objects, "RayService")).items():
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["api-keys"]["secret"] == {
            "secretName": SECRET,
            "items": [{"key": "keys.yaml", "path": "keys.yaml"}],
            "defaultMode": 0o440,  # the pod's group (fsGroup) reads it, nobody else
        }, group
        ray = spec["containers"][0]
        (mount,) = [m for m in ray["volumeMounts"] if m["name"] == "api-keys"]
        assert mount == {"name": "api-keys", "mountPath": MOUNT, "readOnly": True}, group
        for other in spec["containers"][1:] + spec.get("initContainers", []):
            assert "api-keys" not in {m["name"] for m in other.get("volumeMounts", [])}, group
        validate_pod_template(template)


def test_the_application_reads_the_mounted_file(render):
    from cluster.config import ServeConfig

    objects = render({**KEYS, "apiKeysFile": {"existingSecret": SECRET, "secretKey": "k.json"}})
    args = _app_args(objects)
    assert args["api_keys_file"] == f"{MOUNT}/k.json"
    # The Serve config the operator deploys is a valid ServeConfig (the file is read on the
    # cluster, where it is mounted).
    assert ServeConfig.from_args(args).tenants.api_keys_file == f"{MOUNT}/k.json"


def test_a_bad_secret_key_is_refused_by_the_schema(render):
    with pytest.raises(Exception, match="secretKey"):
        render({"apiKeysFile": {"existingSecret": SECRET, "secretKey": "../etc/passwd"}})
