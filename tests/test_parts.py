"""`make test`'s two parts (tests/conftest.py, `--part`): `--part local` keeps the tests that
need no shared Ray and deselects the others (the Ray part); no test of the local part (it
runs beside the Ray part) uses the session's Ray but LOCAL_RAY's, which run last there (on its
own instance), and every OWN_RAY entry is in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import LOCAL_RAY, OWN_RAY

REPO = Path(__file__).resolve().parents[1]

# Collects with --part local; prints what it kept, what it deselected, and which kept tests
# use the session's Ray.
COLLECT = """
import json, sys
import pytest
class Parts:
    deselected = []
    def pytest_deselected(self, items):
        self.deselected += [i.nodeid for i in items]
    def pytest_collection_finish(self, session):
        self.local = [i.nodeid for i in session.items]
        self.uses_ray = [i.nodeid for i in session.items if "ray_session" in i.fixturenames]
parts = Parts()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--part", "local",
                    "tests"], plugins=[parts])
print("PARTS " + json.dumps([parts.local, parts.deselected, parts.uses_ray]))
sys.exit(code)
"""


def test_the_local_part_needs_no_shared_ray_and_the_rest_is_the_ray_part() -> None:
    done = subprocess.run(
        [sys.executable, "-c", COLLECT], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("PARTS ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    local, ray, uses_ray = json.loads(lines[0].removeprefix("PARTS "))
    assert len(local) > 1000 and len(ray) > 200 and not set(local) & set(ray)
    # LOCAL_RAY's Ray tests, and only they, use it there: last, after the others.
    assert {t.split("::")[0] for t in uses_ray} == set(LOCAL_RAY)
    assert local[len(local) - len(uses_ray) :] == uses_ray
    for entry in OWN_RAY:
        own = [t for t in local + ray if t == entry or t.startswith(f"{entry}::")]
        assert own and set(own) <= set(local), entry
    assert "tests/cluster/cli/test_serve.py::test_ctrl_c_while_deploying_stops_cleanly" in ray
    assert any(t.startswith("tests/monitoring/test_prometheus_live.py::") for t in ray)
    assert any(t.startswith("tests/workers/core/test_scheduler.py::") for t in local)
    # A Ray module's tests that need no Ray (flags, reports, one-process parity) run locally.
    assert "tests/cluster/cli/test_serve.py::test_defaults_follow_design" in local
    assert (
        "tests/cluster/cli/test_serve.py::test_serve_joins_a_cluster_serves_and_stops_on_sigterm"
        in ray
    )
