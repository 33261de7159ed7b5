"""The fault schedule of `kvray bench serve --chaos` (seeded, exponential gaps of at least the
minimum) and its injector on stand-in processes: who may be a victim, never one thing twice at
once, repairs seen only after the kill."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.bench.chaos.faults import (
    Injector,
    PlannedFault,
    eligible,
    fault_schedule,
    parse_fault_weights,
)
from cluster.bench.fault.main import pid_gone

# -- the schedule -----------------------------------------------------------------------------


def test_the_schedule_is_seeded_with_exponential_gaps_of_at_least_the_minimum() -> None:
    weights = parse_fault_weights("engine:2,replica:1")
    plan = fault_schedule(3, 50_000.0, 15.0, 1.0, weights)
    assert plan == fault_schedule(3, 50_000.0, 15.0, 1.0, weights)
    assert plan != fault_schedule(4, 50_000.0, 15.0, 1.0, weights)
    times = [p.at_s for p in plan]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert times == sorted(times) and times[-1] < 50_000.0
    assert min(gaps) >= 1.0 - 1e-9
    # Exponential with mean 15, clipped below at 1: E[max(1, X)] = 1 + 15 e^{-1/15} = 15.03.
    assert statistics.mean(gaps) == pytest.approx(15.03, rel=0.03)
    # Two faults close together happen: about 1 - e^{-3/15} = 18 % of gaps are under 3 s.
    assert 0.14 < sum(g < 3.0 for g in gaps) / len(gaps) < 0.23
    kinds = Counter(p.kind for p in plan)
    assert kinds["engine"] / len(plan) == pytest.approx(2 / 3, abs=0.03)
    assert {p.kind for p in fault_schedule(3, 500.0, 5.0, 1.0, {"engine": 1, "replica": 0})} == {
        "engine"
    }
    assert fault_schedule(1, 0.5, 15.0, 1.0, weights) == ()  # nothing fits in half a second


def test_fault_weights_and_the_schedule_refuse_bad_flags() -> None:
    assert parse_fault_weights("replica") == {"replica": 1.0}
    for bad in ("", "engine:-1", "disk:1", "engine:x", "engine:1,engine:2", "engine:0"):
        with pytest.raises(ValueError, match="--chaos-faults"):
            parse_fault_weights(bad)
    with pytest.raises(ValueError, match="--chaos-interval-s"):
        fault_schedule(0, 10.0, 0.0, 1.0, {"engine": 1.0})


# -- victims, on stand-in processes ------------------------------------------------------------


def _standin(kind_module: str) -> subprocess.Popen:
    """A process whose command line names `kind_module`, as a real engine or replica's does;
    returned once it does (between fork and exec its command line is still empty, and a kill
    check made then refuses it: seen on a loaded machine)."""
    import psutil

    code = "import time; time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code, "-m", kind_module])
    deadline = time.monotonic() + 30  # a hang guard, not a measurement
    while kind_module not in " ".join(psutil.Process(proc.pid).cmdline()):
        assert time.monotonic() < deadline, f"{kind_module} stand-in never started"
        time.sleep(0.01)
    return proc


@pytest.fixture
def engines() -> Iterator[list[subprocess.Popen]]:
    procs = [_standin("workers.core.engine_child") for _ in range(3)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


class _StatsHandle:
    """Answers replica_stats as LLMServer does, from a dict the test edits (replica -> stats);
    the call's routing key picks the replica, round robin."""

    def __init__(self, stats: dict[str, dict[str, Any]]) -> None:
        self.stats = stats
        self.replica_stats = self

    def remote(self, route: dict[str, str]) -> Any:
        async def answer() -> dict[str, Any]:
            names = sorted(self.stats)
            return self.stats[names[int(route["routing_key"].rsplit("-", 1)[1]) % len(names)]]

        return answer()


def _stats(replica: str, engine_pid: int | None, pid: int = 1) -> dict[str, Any]:
    return {"replica": replica, "engine_pid": engine_pid, "pid": pid}


def test_a_victim_has_a_live_engine_and_no_fault_being_repaired(
    engines: list[subprocess.Popen],
) -> None:
    a, b, _ = engines
    stats = {"r1": _stats("r1", a.pid), "r2": _stats("r2", b.pid), "r3": _stats("r3", None)}
    assert [s["replica"] for s in eligible(stats, "engine", set(), set())] == ["r1", "r2"]
    assert [s["replica"] for s in eligible(stats, "engine", {"r1"}, set())] == ["r2"]
    assert [s["replica"] for s in eligible(stats, "engine", set(), {b.pid})] == ["r1"]
    # A replica whose engine is dead (restarting) takes no fault of either kind.
    b.kill()
    b.wait()
    assert pid_gone(b.pid)
    assert [s["replica"] for s in eligible(stats, "replica", set(), set())] == ["r1"]


def test_the_injector_never_kills_one_thing_twice_at_once(engines: list[subprocess.Popen]) -> None:
    a, b, c = engines
    handle = _StatsHandle({"r1": _stats("r1", a.pid), "r2": _stats("r2", b.pid)})
    plan = [PlannedFault(0.0, "engine"), PlannedFault(0.05, "engine"), PlannedFault(0.1, "engine")]

    async def go() -> Injector:
        t0 = time.perf_counter()
        injector = Injector(handle, replicas=2, seed=0, t0=t0)
        await injector.run(plan, end=t0 + 1.5)  # the third waits for a victim, in vain
        # r1 "restarts" its engine in place: its repair is noted; r2's is still pending.
        handle.stats["r1"] = _stats("r1", c.pid)
        await injector.settle(time.perf_counter() + 1.0)
        return injector

    injector = asyncio.run(go())
    first, second, third = injector.faults
    assert first.killed and second.killed and not third.killed
    assert {first.replica, second.replica} == {"r1", "r2"}  # never the same replica twice
    assert {first.pid, second.pid} == {a.pid, b.pid} and first.pid_gone and second.pid_gone
    assert "no replica could take it" in third.error and third.at_s is None
    r1 = first if first.replica == "r1" else second
    r2 = second if r1 is first else first
    assert r1.repaired_s is not None and r2.repaired_s is None
    assert not pid_gone(c.pid)  # the new engine was not killed


def test_a_killed_replica_is_repaired_by_a_replacement_not_by_its_last_answer(
    engines: list[subprocess.Popen],
) -> None:
    a, b, c = engines
    actor = _standin("ray::ServeReplica")
    try:
        # r1's stats keep answering with its engine alive (an answer sent just before the
        # kill, or an engine child not yet gone): that is no repair.
        handle = _StatsHandle({"r1": _stats("r1", a.pid, actor.pid), "r2": _stats("r2", b.pid)})

        async def go() -> Injector:
            t0 = time.perf_counter()
            injector = Injector(handle, replicas=2, seed=1, t0=t0)
            # r2 is picked or not by the seed: fix the choice by offering r1 alone.
            handle.stats["r2"]["pid"] = None
            await injector.run([PlannedFault(0.0, "replica")], end=t0 + 1.0)
            await injector.settle(time.perf_counter() + 0.6)
            assert injector.faults[0].repaired_s is None
            del handle.stats["r1"]  # gone for good; Serve's replacement serves:
            handle.stats["r3"] = _stats("r3", c.pid)
            await injector.settle(time.perf_counter() + 1.0)
            return injector

        (fault,) = asyncio.run(go()).faults
        assert fault.killed and fault.replica == "r1" and fault.pid == actor.pid
        assert actor.wait(timeout=30) == -9
        assert fault.repaired_s is not None
    finally:
        actor.kill()
        actor.wait()
