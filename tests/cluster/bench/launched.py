"""`kvray bench serve --launch` as a child process of a test: the bench starts a Ray instance
and the kvray app of its own, and both end with the process. Such a test needs nothing of the
session's Ray, so `make test` runs it in the local part, beside the shared Ray's tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cluster.deploy.serve_env import LOCAL_PORT_KEYS
from tests.cluster.serve_helpers import KV_CACHE_BYTES

REPO = Path(__file__).resolve().parents[3]


def run_launched(argv: list[str], timeout_s: float = 420.0) -> int:
    """Runs `kvray bench serve --launch` with `argv` (the demo model, 2 replicas of the
    tests' KV cache size unless argv says otherwise); returns its exit code. Its output is
    printed (pytest shows it when the test fails)."""
    cmd = [sys.executable, "-m", "cluster.cli.main", "bench", "serve", "--launch"]
    cmd += ["--num-replicas", "2", "--kv-cache-memory", str(KV_CACHE_BYTES), *argv]
    # The session's shared instance (`--part all`) may have set these: the launched one picks
    # its own, or it would bind the shared instance's HAProxy ports.
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_PORT_KEYS}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    print(done.stdout[-6000:], done.stderr[-6000:], sep="\n")
    return done.returncode
