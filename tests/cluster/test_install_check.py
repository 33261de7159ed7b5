"""cluster.install_check walks a package on disk and reports each module that fails to import;
tests/test_packaging.py runs it on an installed wheel."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.install_check import import_all

PKG = "install_check_demo_pkg"


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / PKG
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "fine.py").write_text("VALUE = 1\n")
    (root / "sub" / "broken.py").write_text("import no_such_module_anywhere\n")
    # Importing a __main__ would run its command: the walk must never do it.
    (root / "__main__.py").write_text("raise SystemExit('ran __main__')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
        del sys.modules[name]


def test_walks_subpackages_and_reports_the_module_that_fails(package: Path) -> None:
    imported, failed = import_all((PKG,))
    assert imported == [PKG, f"{PKG}.sub", f"{PKG}.sub.fine"]
    assert list(failed) == [f"{PKG}.sub.broken"]
    assert "No module named 'no_such_module_anywhere'" in failed[f"{PKG}.sub.broken"]


def test_a_package_that_fails_is_reported_once_and_not_walked(package: Path) -> None:
    (package / "sub" / "__init__.py").write_text("raise RuntimeError('broken package')\n")
    imported, failed = import_all((PKG,))
    assert imported == [PKG]
    assert failed == {f"{PKG}.sub": "RuntimeError: broken package"}
