"""`kvray bench kv-tier` on the demo model, in this process, on a Ray of its own (it needs no
Serve: the local part of `make test` runs it beside the shared Ray's tests): every arm
at every length, the greedy tokens of each arm equal to the recompute arm's, and the pull arms
really pulled; whether the learned cost model picked the faster arm, counted; a small chat
on 2 replicas, whose prefix-hit rate with the tier beats today's. Tiny sizes: the figures
themselves are the benchmark's business, not a test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.bench.kv_tier.report import ARM_KEYS
from cluster.cli.main import main


def test_every_arm_runs_and_matches(tmp_path: Path) -> None:
    import ray

    out = tmp_path / "kv.json"
    argv = ["bench", "kv-tier", "--prefix-lengths", "64,128", "--repeats", "1", "--threads", "1"]
    chat = ["--chat-conversations", "2", "--chat-turns", "3", "--chat-system-len", "32"]
    chat += ["--chat-user-len", "16", "--chat-answer-len", "8"]
    rc = main([*argv, *chat, "--result-json", str(out)])
    assert not ray.is_initialized()  # the Ray it started, stopped
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
        # The engine counts a pulled block's tokens as cached (restored from the host tier).
        assert all(
            s["cached_tokens"] >= s["pulled_blocks"] * 16 for s in result["samples"][n]["pull"]
        )
        picked = row["auto_picked_faster"]
        assert picked["rounds"] + picked["ties"] == 1 and picked["right"] <= picked["rounds"]
    assert result["tier_stats"]["peer"]["pulled_blocks"] > 0
    picked = result["auto_picked_faster"]
    assert picked["rounds"] + picked["ties"] == 2 and 0 <= picked["right"] <= picked["rounds"]
    assert picked["rounds"] == 0 or picked["share"] == picked["right"] / picked["rounds"]

    chat = result["chat"]
    assert chat["outputs_match"] and chat["mismatches"] == []
    assert chat["today"]["turns"] == chat["tier"]["turns"] == 6
    assert chat["today"]["prompt_tokens"] == chat["tier"]["prompt_tokens"] == 2 * (48 + 72 + 96)
    assert [t["replica"] for t in chat["samples"]["tier"]] == [0, 1, 0, 1, 0, 1]
    # Round robin without the tier: a replica finds only the turn before last, or the system
    # prompt; with it, turn 1 of conversation 0 pulls what the other replica computed.
    assert chat["today"]["pulled_turns"] == 0 and chat["tier"]["pulled_turns"] >= 1
    assert chat["tier"]["hit_rate"] > chat["today"]["hit_rate"] > 0
    assert chat["hit_rate_ratio"] > 1
    assert chat["tier"]["outcomes"]["pulled"] == chat["tier"]["pulled_turns"]
    assert set(chat["tier_stats_after"]) == {"auto", "peer"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefix-lengths", "1024,4096"], "max_model_len (2048)"),
        (["--prefix-lengths", "64,x"], "not a comma-separated list"),
        (["--model", "random:qwen3-7t"], "unknown random model"),
        (["--chat-turns", "-1"], "--chat-turns must be at least 0"),
        (["--chat-conversations", "-1"], "--chat-conversations must be at least 0"),
        (["--chat-system-len", "2000"], "--chat-system-len 2000: .* max_model_len (2048)"),
    ],
)
def test_bad_arguments_are_refused_before_ray_starts(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        main(["bench", "kv-tier", *argv])
