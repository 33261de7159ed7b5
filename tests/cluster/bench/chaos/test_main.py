"""`kvray bench serve --chaos`: the flags it refuses, and one real run that kills engines and a
replica of a 2-replica deployment under a mixed load: nothing lost, no output changed."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.bench.chaos.faults import fault_schedule
from cluster.bench.chaos.main import chaos_plan
from cluster.bench.chaos.workload import ChaosMix, parse_priorities
from cluster.bench.fault.main import pid_gone
from cluster.bench.serve import main as bench_serve
from tests.cluster.serve_helpers import KV_CACHE_BYTES, App, ServePorts, deploy


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flags_are_checked() -> None:
    for bad in ("0:1,0:2", "x:1", "1", "0:0", ""):
        with pytest.raises(ValueError, match="--chaos-priorities"):
            parse_priorities(bad)
    with pytest.raises(ValueError, match="--chaos-output-len"):
        ChaosMix(output_len=(9, 3))
    for argv in (
        ["--launch", "--backend", "grpc"],
        ["--launch", "--fault-at", "3"],
        ["--base-url", "http://127.0.0.1:1"],  # no Ray connection to find the replicas
        ["--launch", "--chaos-faults", "disk:1"],
        ["--launch", "--chaos-priorities", "a:b"],
    ):
        assert bench_serve.run(_args("--chaos", "5", *argv)) == 2, argv
    assert bench_serve.run(_args("--chaos", "0", "--launch")) == 2


def test_the_plan_is_the_flags_schedule() -> None:
    plan = chaos_plan(_args("--chaos", "60", "--seed", "5", "--chaos-interval-s", "5"))
    assert plan == fault_schedule(5, 60.0, 5.0, 1.0, {"engine": 2.0, "replica": 1.0})
    assert plan != chaos_plan(_args("--chaos", "60", "--seed", "6", "--chaos-interval-s", "5"))


# -- one real run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chaos_app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    from cluster.config import ServeConfig

    config = ServeConfig.from_flat(
        num_replicas=2,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=8,
        tenant_header="x-tenant-id",
        api_key_env="KVRAY_CHAOS_NO_KEY",  # unset on the cluster: no key required
    )
    app = deploy("kvray-chaos", "/chaos", config, serve_ports, None)
    yield app
    serve.delete(app.name)


@pytest.mark.slow
def test_a_real_run_loses_nothing_and_changes_nothing(chaos_app: App, tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    args = _args(
        "--base-url", chaos_app.base_url, "--app-name", chaos_app.name, "--num-replicas", "2",
        "--chaos", "22", "--chaos-interval-s", "6", "--seed", "172", "--max-concurrency", "8",
        "--chaos-output-len", "16", "64", "--input-len", "64", "--chaos-metrics-wait-s", "2",
        "--fault-recovery-timeout-s", "0", "--result-json", str(out),
    )  # fmt: skip
    # This seed's schedule: an engine, then a replica and, a second later, an engine again
    # (the second replica's, the first one being replaced): a while with no healthy replica.
    plan = chaos_plan(args)
    assert [p.kind for p in plan] == ["engine", "replica", "engine"]
    assert plan[2].at_s - plan[1].at_s < 1.5
    rc = bench_serve.run(args)
    s = json.loads(out.read_text())["chaos"]
    q, o, f = s["requests"], s["outputs"], s["faults"]
    assert q["lost"] == 0, q["lost_examples"]
    # A 10-minute soak changed the text of 2 seeded streams in 11,922 requests (none greedy):
    # the offline engine itself answers those two requests in two ways depending on the batch
    # (float rounding flips a seeded draw at a near tie; docs/benchmarks.md, "Chaos soak").
    # Greedy outputs must never change; one seeded change is tolerated so that such a tie does
    # not make the suite flaky.
    assert [c for c in o["changes"] if ", seed " not in c] == [], o["changes"]
    assert o["changed"] <= 1, o["changes"]
    assert q["completed"] > 0 and o["compared"] == q["completed"]
    assert q["completed"] + q["failed"] == q["sent"]
    assert o["structured"]["completed"] > 0 and o["greedy"] > 0 and o["seeded"] > 0
    assert f["injected"] == 3, f["not_injected"]
    assert f["by_kind"] == {"engine": 2, "replica": 1}
    assert all(x["pid_gone"] and pid_gone(x["pid"]) for x in f["list"])
    assert len({x["pid"] for x in f["list"]}) == 3
    # The faults hit requests in flight, and the routers moved them.
    assert s["migrations"] is not None and sum(s["migrations"].values()) >= 1
    assert set(s["tenants"]) == {"tenant-0", "tenant-1", "tenant-2"}
    assert rc == 0 or o["changed"] == 1
