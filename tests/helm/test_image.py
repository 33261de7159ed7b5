"""The chart and the serving image (Dockerfile) agree: Ray version, kvray version, and the image
carries every package the Serve application imports. No image is built here (no daemon in CI);
these are the consistency checks a build would only reveal on a cluster."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.helm.helpers import CHART_DIR, REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, f"Dockerfile has no default for ARG {name}"
    return match.group(1)


def test_image_ray_version_is_the_chart_ray_version():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert _arg("RAY_VERSION") == values["ray"]["version"]
    assert "FROM rayproject/ray:${RAY_VERSION}-" in DOCKERFILE.read_text()


def test_chart_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


def test_image_context_holds_the_serve_application():
    """.dockerignore lets through the packages the Serve config imports (cluster.app, the gRPC
    stubs under proto/, the engine) and the files pip needs to install them."""
    allowed = {
        line[1:].rstrip("/")
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert {"pyproject.toml", "workers", "cluster", "proto"} <= allowed
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    if isinstance(project.get("readme"), str):
        assert project["readme"] in allowed
    for path in allowed:
        assert f" {path}" in DOCKERFILE.read_text(), f"{path} is in the context but never copied"


def test_the_image_installs_every_package():
    """The image pip-installs the project (not the source tree): a package missing from
    pyproject's list is absent from the image, and its first import fails on the cluster."""
    listed = set(
        tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(REPO_ROOT).parts)
        for top in ("workers", "cluster")
        for init in (REPO_ROOT / top).rglob("__init__.py")
    }
    assert found - listed == set()
