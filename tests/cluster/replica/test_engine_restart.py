"""EngineSupervisor with real engine child processes: a killed child is replaced by a new
engine that serves the same outputs, and a child that keeps dying makes the supervisor give
up (the replica's health check then fails and Serve replaces it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from cluster.replica.engine_restart import EngineSupervisor
from workers import AsyncEngine, EngineArgs, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def _text(engine: AsyncEngine, rid: str) -> str:
    outs = [out async for out in engine.generate("Once upon a time", GREEDY, rid)]
    assert outs and outs[-1].finished
    return "".join(o.outputs[0].delta_text for o in outs)


async def _until(cond, timeout_s: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_killed_engine_child_is_restarted_until_the_budget_is_spent(demo_dir: Path) -> None:
    args = EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20)
    restarted: list[AsyncEngine] = []

    async def main() -> None:
        sup = EngineSupervisor(
            lambda: AsyncEngine(args, process=True),
            AsyncEngine(args, process=True),
            max_restarts=2,
            window_s=300.0,
            on_restart=restarted.append,
        )
        task = asyncio.create_task(sup.run())
        try:
            want = await _text(sup.engine, "before")
            for k in range(2):
                first = sup.engine
                os.kill(first.engine_pid, signal.SIGKILL)
                await _until(lambda first=first: sup.engine is not first and sup.engine.healthy)
                assert not sup.restarting and not sup.gave_up
                assert sup.last_restart_s is not None and sup.last_restart_s > 0
                assert await _text(sup.engine, f"after-{k}") == want  # the same model, again
            assert len(restarted) == 2 and restarted[-1] is sup.engine
            # A third death within the window: no restart left; the health check would fail.
            last = sup.engine
            os.kill(last.engine_pid, signal.SIGKILL)
            await _until(lambda: not last.healthy)
            await asyncio.sleep(0.5)  # a few supervisor polls
            assert sup.engine is last and sup.gave_up and not sup.restarting
        finally:
            task.cancel()
            sup.engine.shutdown()

    asyncio.run(main())


def test_a_thread_core_is_never_restarted_in_place(demo_dir: Path) -> None:
    """TP > 1 runs the engine core as a thread, its ranks as Ray actors: Serve replaces such
    a replica. An in-process engine that died makes the supervisor give up at once."""
    engine = AsyncEngine(EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20))
    engine.shutdown()
    sup = EngineSupervisor(lambda: pytest.fail("no restart expected"), engine)
    assert engine.in_process and not engine.healthy
    assert sup.gave_up
