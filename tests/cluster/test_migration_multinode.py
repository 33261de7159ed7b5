"""A node dies mid-stream: its replica's requests continue on the other node's replica.

A real two-node Ray cluster on this machine (tests/cluster/multinode.py: `ray start --head`
plus a second raylet joining it), 2 engine replicas placed one per node, the ingress on the
head; the worker node's raylet is SIGKILLed while 32 long requests stream. Every request
must end with the text of an undisturbed run, and the surviving replica with no KV block
held. The cluster KV tier is on: the blocks the dead node published die with it. Runs
without the session's Ray instance: the driver is its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.deploy.serve_env import apply_serve_env
from tests.cluster.multinode import TwoNodeCluster
from tests.cluster.serve_helpers import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_node_killed_mid_stream(tmp_path: Path) -> None:
    env = dict(os.environ)
    # Serve's Python proxy, on the head only: HAProxy would outlive this cluster.
    env.update({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0"})
    # Both raylets and the driver are this machine's processes; no token to hand around.
    env["RAY_AUTH_MODE"] = "disabled"
    apply_serve_env(env)
    env["OMP_NUM_THREADS"] = "1"
    cluster = TwoNodeCluster(env)
    try:
        assert len(cluster.raylet_pids()) == 2
        worker_raylet = cluster.worker_raylet_pid()
        out = tmp_path / "result.json"
        driver = subprocess.run(
            [sys.executable, "-m", "tests.cluster.multinode", cluster.address,
             str(free_port()), str(free_port()), str(out)],
            cwd=REPO,
            env={**env, "KVRAY_TEST_KILL_PID": str(worker_raylet)},
            capture_output=True,
            text=True,
            timeout=600,
        )  # fmt: skip
        assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-5000:]
        result = json.loads(out.read_text())
    finally:
        cluster.close()
    assert result["replica_nodes"] == 2, result
    assert result["victim_running"] > 0, result
    assert result["failures"] == [], result
    assert result["survivor_blocks"] == [0] and result["survivor_nodes"] == [True], result
    assert all(s["refused"] == 0 for s in result["kv_share"]), result
