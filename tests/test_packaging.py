"""What a non-editable install (`pip install .`, as the Dockerfile does) ships besides code."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_package_data_covers_the_data_files_the_code_reads():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["workers"]
    shipped = {p for g in globs for p in (ROOT / "workers").glob(g)}
    needed = [
        *(ROOT / "workers").rglob("*.c"),
        *(ROOT / "workers").rglob("*.h"),  # the kernels' shared header
        *(ROOT / "workers" / "demo_corpus").glob("*.txt"),
    ]
    assert needed
    missing = sorted(str(p.relative_to(ROOT)) for p in needed if p not in shipped)
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
