"""`kvray serve --api-keys-file`: a bad or missing file is a one-line start-up error naming the
file and the field, before Ray or anything else starts; the flags are in --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli.main", "serve", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("keys:\n  - {key: sk-a, tokens_per_s: -5}\n", "keys[0].tokens_per_s must be a number > 0"),
        ("keys:\n  - {key: sk-a}\n  - {key: sk-a}\n", "keys[1].key repeats the key of keys[0]"),
        ("keys:\n  - {key: sk-a, rate: 3}\n", "keys[0].rate is not a known field"),
        ("keys: [\n", "not valid YAML or JSON"),
    ],
)
def test_a_bad_keys_file_stops_kvray_serve_before_it_starts(
    tmp_path: Path, text: str, field: str
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    done = _serve("--api-keys-file", str(path))
    assert done.returncode == 2, done
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"kvray serve: api_keys_file {path}: "), line
    assert field in line
    assert "Traceback" not in done.stdout + done.stderr
    assert "Ray" not in done.stdout  # nothing started


def test_a_missing_keys_file_too(tmp_path: Path) -> None:
    done = _serve("--api-keys-file", str(tmp_path / "nope.yaml"))
    assert done.returncode == 2, done
    assert (
        done.stderr.strip() == f"kvray serve: api_keys_file {tmp_path / 'nope.yaml'}: no such file"
    )


def test_help_explains_the_tenant_flags() -> None:
    done = _serve("--help")
    text = " ".join(done.stdout.split())
    for flag in (
        "--api-keys-file",
        "--tenant-header",
        "--tenant-requests-per-s",
        "--tenant-tokens-per-s",
    ):
        assert flag in text
    assert "only as trustworthy as the proxy that sets it" in text
