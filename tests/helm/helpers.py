"""Paths, value sets and small accessors shared by the chart tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "kvray"
EXAMPLES_DIR = CHART_DIR / "examples"
# KubeRay v1.7.0's CRDs sit next to the repository in CI (../shared/schemas), not inside it.
CRD_DIR = REPO_ROOT.parent / "shared" / "schemas"
RELEASE = "kvray-test"
NAMESPACE = "llm"


def example_values(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES_DIR / f"{name}.yaml").read_text())


# name -> user values (None: the chart's defaults only)
VALUE_SETS: dict[str, dict[str, Any] | None] = {
    "default": None,
    **{p.stem: example_values(p.stem) for p in sorted(EXAMPLES_DIR.glob("*.yaml"))},
}


def parse_manifests(manifests: dict[str, str]) -> list[dict[str, Any]]:
    """Helm's rendered templates (path -> text) as objects; NOTES.txt and empty ones left out."""
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith("NOTES.txt"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The single object of `kind`; fails when there is none or several."""
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def pod_templates(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """'head' and each worker group's name -> its pod template."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    return templates


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])
