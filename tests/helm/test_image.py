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


def _stages() -> list[str]:
    """The Dockerfile's build stages, each from its FROM line, backslash-continued lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return ["FROM" + s for s in re.split(r"^FROM", text, flags=re.MULTILINE)[1:]]


def test_image_installs_the_wheel_built_from_the_sources_and_imports_every_module():
    """The sources go into a stage that builds the wheel; the serving image gets the wheel
    alone (what `pip install kvray-*.whl` installs anywhere, not a source tree that would
    hide a file the wheel lacks), keeps Ray and torch pinned, and imports every module."""
    *builders, final = _stages()
    wheel_stages = [s for s in builders if "pip wheel" in s and "--no-deps" in s]
    assert len(wheel_stages) == 1, "no build stage (before the last) makes kvray's wheel"
    (wheel_stage,) = wheel_stages
    assert " workers/" in wheel_stage and " cluster/" in wheel_stage
    # No sources in this stage: `python -m` (the check) imports from the working directory
    # first, where a source tree would stand in for the install.
    assert not re.search(r"^(COPY|ADD) ", final, re.MULTILINE), "the serving stage copies files"
    (install,) = [line for line in final.splitlines() if re.match(r"RUN .*\.whl", line)]
    assert re.search(r'pip install [^&]*kvray-\*\.whl\)?\[otel\]"', install), install
    for pin in ('"ray[serve]==${RAY_VERSION}"', '"torch==${TORCH_VERSION}"'):
        assert pin in install
    check = "python -m cluster.install_check"
    assert check in install, "the install is not checked in the layer that makes it"
    assert (REPO_ROOT / "cluster" / "install_check.py").is_file()
