"""The faults of `kvray bench serve --chaos`: when (a seeded schedule), what (a random replica's
engine process or actor), and when each victim served again.

Schedule (`fault_schedule`): gaps drawn from an exponential distribution with mean
`--chaos-interval-s`, each at least `--chaos-min-gap-s`, kinds drawn by the weights of
`--chaos-faults` (engine:2,replica:1 by default), all from the seed. Exponential gaps put two
faults close together now and then (a short gap is as likely as any other of its length),
which is what the chaos run is for: the second fault lands while the first is being repaired.

Injection (`Injector`): at each planned time, a replica is chosen at random among those that
can take this fault now: its stats answered, its engine is alive (a live process, not one that
was killed before: a restarting replica still names its dead engine), and no earlier fault of
this run is still being repaired on it. So the same thing is never killed twice at once. With
none eligible (every replica down or repairing) the fault waits for one, until the run ends.
The kill itself is `fault.kill_process`: SIGKILL after checking the target's command line,
so the replicas must run on this machine.

A fault is repaired when its replica serves again with a live engine (an engine restarted in
place), or when `replicas` other replicas do (Serve replaced the replica); `Injector.watch`
notes the time, from replica stats asked for after the kill.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.bench.fault.main import KINDS, all_replica_stats, kill_process, pid_gone, target_pid

DEFAULT_FAULTS = "engine:2,replica:1"
POLL_S = 0.5  # between looks at the replicas while a fault waits or a victim is repaired
STATS_TIMEOUT_S = 15.0  # one look at every replica's stats, at most
GONE_TIMEOUT_S = 5.0  # SIGKILL is not instant: the longest wait for the target to be gone


@dataclass(frozen=True)
class PlannedFault:
    at_s: float  # seconds from the start of the timed run
    kind: str  # "engine" | "replica"


@dataclass
class Fault:
    """One fault of the run: planned, then done (or not, and why)."""

    planned_s: float
    kind: str
    at_s: float | None = None  # when the signal went, from the run's start (None: not sent)
    replica: str = ""
    pid: int | None = None
    pid_gone: bool = False
    eligible: int = 0  # replicas that could take it when it fired
    repaired_s: float | None = None  # from the kill to its replica (or a replacement) serving
    error: str = ""

    @property
    def killed(self) -> bool:
        return self.at_s is not None and not self.error


def parse_fault_weights(text: str) -> dict[str, float]:
    """'engine:2,replica:1' -> {"engine": 2.0, "replica": 1.0}; ValueError naming the flag."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        kind, _, weight = part.partition(":")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if kind not in KINDS or w < 0 or kind in out:
            raise ValueError(
                f"--chaos-faults must be KIND[:WEIGHT],... with KIND one of {', '.join(KINDS)} "
                f"(each once) and WEIGHT >= 0, got {text!r}"
            )
        out[kind] = w
    if not out or sum(out.values()) <= 0:
        raise ValueError(f"--chaos-faults needs a kind with a weight above 0, got {text!r}")
    return out


def fault_schedule(
    seed: int, duration_s: float, mean_s: float, min_gap_s: float, weights: dict[str, float]
) -> tuple[PlannedFault, ...]:
    """The faults of a run of `duration_s` (module doc): the same for the same arguments."""
    if mean_s <= 0 or min_gap_s < 0:
        raise ValueError("--chaos-interval-s must be > 0 and --chaos-min-gap-s >= 0")
    rng = random.Random(seed * 7_919 + 17)
    kinds = sorted(weights)
    out: list[PlannedFault] = []
    t = 0.0
    while True:
        t += max(min_gap_s, rng.expovariate(1.0 / mean_s))
        kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        if t >= duration_s:
            return tuple(out)
        out.append(PlannedFault(round(t, 3), kind))


def engine_alive(stats: dict[str, Any], killed: set[int]) -> bool:
    """The replica's engine runs: a live process of this machine that this run did not kill."""
    pid = stats.get("engine_pid")
    return pid is not None and pid not in killed and not pid_gone(pid)


def eligible(
    stats: dict[str, dict[str, Any]], kind: str, busy: set[str], killed: set[int]
) -> list[dict[str, Any]]:
    """The replicas that can take a fault of `kind` now (module doc), by replica id."""
    out = []
    for replica, s in sorted(stats.items()):
        pid = target_pid(s, kind)
        if replica in busy or pid is None or pid in killed or not engine_alive(s, killed):
            continue
        out.append(s)
    return out


class Injector:
    """Fires a schedule's faults at replicas of `handle` (an LLMServer handle), notes each."""

    def __init__(self, handle: Any, replicas: int, seed: int, t0: float) -> None:
        self._handle = handle
        self._replicas = replicas
        self._rng = random.Random(seed * 104_729 + 3)  # which eligible replica is the victim
        self._t0 = t0
        self.killed: set[int] = set()  # every pid this run signalled
        self.faults: list[Fault] = []

    def _pending(self) -> list[Fault]:
        return [f for f in self.faults if f.killed and f.repaired_s is None]

    async def _stats(self) -> dict[str, dict[str, Any]]:
        try:
            return await asyncio.wait_for(
                all_replica_stats(self._handle, self._replicas), STATS_TIMEOUT_S
            )
        except TimeoutError:
            return {}

    async def _look(self) -> dict[str, dict[str, Any]]:
        """Every replica's stats, and the repairs they show."""
        asked = time.perf_counter()
        stats = await self._stats()
        self._note_repairs(stats, asked, time.perf_counter())
        return stats

    def _note_repairs(self, stats: dict[str, dict[str, Any]], asked: float, now: float) -> None:
        """Repairs shown by `stats`, asked for at `asked`: only faults from before then count
        (an answer sent just before a kill still shows the victim well). A killed replica
        actor never comes back: only `replicas` others repair it (Serve's replacement)."""
        alive = {r for r, s in stats.items() if engine_alive(s, self.killed)}
        for f in self._pending():
            if f.at_s is None or self._t0 + f.at_s > asked:
                continue
            back = f.kind == "engine" and f.replica in alive
            if back or len(alive - {f.replica}) >= self._replicas:
                f.repaired_s = max(0.0, now - self._t0 - f.at_s)

    async def run(self, plan: Sequence[PlannedFault], end: float) -> None:
        """Fires every planned fault due before `end` (perf_counter time)."""
        for p in plan:
            due = self._t0 + p.at_s
            if due >= end:
                return
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            fault = Fault(p.at_s, p.kind)
            self.faults.append(fault)
            await self._fire(fault, end)

    async def _fire(self, fault: Fault, end: float) -> None:
        while True:
            stats = await self._look()
            now = time.perf_counter()
            busy = {f.replica for f in self._pending()}
            victims = eligible(stats, fault.kind, busy, self.killed)
            if victims:
                break
            if now >= end:
                fault.error = (
                    f"no replica could take it before the run ended ({len(stats)} answered; "
                    "each was down, repairing an earlier fault, or not on this machine)"
                )
                return
            await asyncio.sleep(POLL_S)
        victim = self._rng.choice(victims)
        pid = target_pid(victim, fault.kind)
        assert pid is not None  # eligible() checked
        fault.replica, fault.pid, fault.eligible = victim["replica"], pid, len(victims)
        fault.error = kill_process(pid, fault.kind)
        fault.at_s = time.perf_counter() - self._t0
        if fault.error:
            return
        self.killed.add(pid)
        deadline = time.perf_counter() + GONE_TIMEOUT_S
        while not pid_gone(pid) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        fault.pid_gone = pid_gone(pid)
        print(
            f"t={fault.at_s:.2f} s: killed the {fault.kind} of replica {fault.replica} "
            f"(pid {pid}; planned at {fault.planned_s:.2f} s, {len(victims)} eligible)",
            flush=True,
        )

    async def watch(self) -> None:
        """Notes repairs, one look at the replicas every POLL_S, until cancelled (run it
        beside `run`: a repair is seen when it happens, not at the next fault)."""
        while True:
            await self._look()
            await asyncio.sleep(POLL_S)

    async def settle(self, deadline: float) -> None:
        """After the run: notes repairs until none is pending or `deadline` (perf_counter)."""
        while self._pending() and time.perf_counter() < deadline:
            await self._look()
            if self._pending():
                await asyncio.sleep(POLL_S)
