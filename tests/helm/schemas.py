"""Offline schema checks for rendered objects: Kubernetes' own OpenAPI schemas (bundled by
kubernetes-validate) and the KubeRay CRD's openAPIV3Schema.

Both are applied strictly, as `kubectl apply` (server-side field validation "Strict") would:
an unknown field is an error, not silently dropped.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest the bundled
# schemas know.
K8S_VERSIONS = ("1.27", kubernetes_validate.latest_version())


class UnknownKind(Exception):
    """No bundled Kubernetes schema for this apiVersion/kind (a CRD such as PodMonitor)."""


def validate_k8s(obj: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError naming the field when `obj` is invalid for any of
    K8S_VERSIONS, UnknownKind when Kubernetes has no such built-in kind."""
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError as err:
            raise UnknownKind(err.message) from err


def validate_pod_template(template: dict[str, Any]) -> None:
    """A pod template embedded in a custom resource, checked as a core/v1 PodTemplate."""
    wrapper = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "embedded"},
        "template": template,
    }
    validate_k8s(wrapper)


@cache
def crd_validator(crd_path: Path, version: str = "v1") -> jsonschema.protocols.Validator:
    crd = yaml.load(crd_path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(served["schema"]["openAPIV3Schema"])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Forbids fields a structural CRD schema does not declare (the API server would prune or,
    with strict field validation, reject them)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema
