"""`kvray bench kv-tier` on the demo model, in this process, on the session's Ray: every arm
at every length, the greedy tokens of each arm equal to the recompute arm's, and the pull arms
really pulled. Tiny sizes: the figures themselves are the benchmark's business, not a test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.bench.kv_tier.report import ARM_KEYS
from cluster.cli.main import main
from tests.cluster.serve_helpers import RaySession


def test_every_arm_runs_and_matches(ray_session: RaySession, tmp_path: Path) -> None:
    import ray

    out = tmp_path / "kv.json"
    argv = ["bench", "kv-tier", "--prefix-lengths", "64,128", "--repeats", "1"]
    rc = main([*argv, "--threads", "1", "--result-json", str(out)])
    assert ray.is_initialized()  # the session's Ray, left running
    result = json.loads(out.read_text())
    assert rc == 0 and result["outputs_match"] and result["mismatches"] == []
    assert result["prefix_lengths"] == [64, 128]
    for n in ("64", "128"):
        row = result["summary"][n]
        for arm in ARM_KEYS:
            assert len(result["samples"][n][arm]) == 1
            assert row[arm]["p50_ms"] > 0
        # The whole prefix (its blocks of 16) pulled; the failover also the streamed tokens'.
        assert row["pull_blocks"] >= int(n) // 16
        assert row["failover_pull_blocks"] > row["pull_blocks"]
        assert all(s["outcome"] == "pulled" for s in result["samples"][n]["pull"])
        assert all(s["outcome"] is None for s in result["samples"][n]["recompute"])
    assert result["tier_stats"]["peer"]["pulled_blocks"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefix-lengths", "1024,4096"], "max_model_len (2048)"),
        (["--prefix-lengths", "64,x"], "not a comma-separated list"),
        (["--model", "random:qwen3-7t"], "unknown random model"),
    ],
)
def test_bad_arguments_are_refused_before_ray_starts(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        main(["bench", "kv-tier", *argv])
