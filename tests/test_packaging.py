"""What a non-editable install ships: the wheel built from the tracked tree (as the Dockerfile
builds it) holds every tracked file of the packages, and every module imports from it alone.

The suite itself runs on an editable install, which finds any file in the checkout; only a
wheel shows what `pip install .` and the serving image really get.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cluster.install_check import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
# Where each top-level package lives in the tree (the gRPC stubs are generated under proto/).
SOURCE_DIRS = {"workers": "workers", "cluster": "cluster", "kvray": "proto/kvray"}


@dataclass(frozen=True)
class InstalledWheel:
    wheel: Path
    target: Path  # `pip install --target` of the wheel, nothing else in it


def _tracked_files(*paths: str) -> list[str]:
    """The checkout's tracked files under `paths` that exist in the working tree (so an
    uncommitted edit is built too, and a deleted file is not)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *paths],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): no tracked tree to build")
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def _image_context() -> list[str]:
    """The paths the serving image is built from: the ones .dockerignore lets through."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line[1:].rstrip("/") for line in lines if line.startswith("!")]


def _isolation() -> list[str]:
    """--no-build-isolation when this environment already has the build's requirements (no
    download: the test runs offline, and faster); else pip fetches them, isolated. A fresh
    Python 3.11 venv carries a setuptools too old for pyproject.toml."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    for requirement in map(Requirement, requires):
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            return []
        if not requirement.specifier.contains(installed, prereleases=True):
            return []
    return ["--no-build-isolation"]


def _pip(*args: str | Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", *map(str, args)], check=True)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> InstalledWheel:
    tmp = tmp_path_factory.mktemp("wheel")
    src, out, target = tmp / "src", tmp / "dist", tmp / "site"
    for rel in _tracked_files(*_image_context()):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    _pip("wheel", "-q", "--no-deps", *_isolation(), "-w", out, src)
    (wheel,) = out.glob("kvray-*.whl")
    _pip("install", "-q", "--no-deps", "--target", target, wheel)
    return InstalledWheel(wheel, target)


def test_every_directory_of_code_is_a_package() -> None:
    """Package discovery skips a directory without __init__.py, and with it all its code."""
    dirs = {p.parent for d in SOURCE_DIRS.values() for p in (ROOT / d).rglob("*.py")}
    missing = sorted(str(d.relative_to(ROOT)) for d in dirs if not (d / "__init__.py").exists())
    assert not missing, f"directories holding code without an __init__.py: {missing}"


def test_the_wheel_ships_every_tracked_file_of_the_packages(installed: InstalledWheel) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    expected = {}
    for package, source in SOURCE_DIRS.items():
        for rel in _tracked_files(source):
            expected[rel] = package + rel.removeprefix(source)
    assert expected
    missing = sorted(rel for rel, name in expected.items() if name not in names)
    assert not missing, "tracked but not in the wheel (pyproject.toml [tool.setuptools])"
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == set(PACKAGES), "the wheel installs other top-level names (tests?)"


def test_every_module_imports_from_the_installed_wheel(
    installed: InstalledWheel, tmp_path: Path
) -> None:
    """`python -m cluster.install_check`, as the image runs it, on a path of the wheel's
    install and the venv's site-packages only. -S: no .pth file runs, so the editable
    install's finder (__editable__*.pth in site-packages) never sees the checkout; PYTHONPATH
    is replaced, and the working directory is empty."""
    site_packages = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(installed.target), *site_packages])
    run = subprocess.run(
        [sys.executable, "-S", "-m", "cluster.install_check"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = (line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    loaded = {package: file for package, file in lines if package in PACKAGES}
    assert set(loaded) == set(PACKAGES), run.stdout
    for package, file in loaded.items():
        assert Path(file).is_relative_to(installed.target), f"{package} loaded from {file}"
