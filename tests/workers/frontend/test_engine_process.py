"""The engine core in a child process: its failures reach every caller, and it never outlives
its parent or leaks a process."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.workers.failures import assert_dead_for_good, fail_while_streaming
from workers import AsyncEngine, SamplingParams
from workers.config import EngineArgs
from workers.errors import EngineDeadError

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def _args(model: Path) -> EngineArgs:
    return EngineArgs(model=str(model), kv_cache_memory_bytes=16 << 20)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_shutdown_stops_the_child_cleanly(demo_dir) -> None:
    eng = AsyncEngine(_args(demo_dir), process=True)

    async def main():  # noqa: ANN202
        return [o async for o in eng.generate("hello", SamplingParams(max_tokens=12), "d")]

    try:
        outs = asyncio.run(main())
    finally:
        eng.shutdown()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
    assert eng._core._proc.returncode == 0  # StopEngine, then EngineStopped, then exit 0


def test_killed_child_fails_every_caller(demo_dir) -> None:
    eng = AsyncEngine(_args(demo_dir), process=True)
    try:
        results = fail_while_streaming(eng, LONG, lambda: os.kill(eng._core.pid, signal.SIGKILL))
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert_dead_for_good(eng, LONG, match="exited")
    finally:
        eng.shutdown()


def test_child_that_cannot_load_the_model_fails_the_constructor(demo_dir, tmp_path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(demo_dir, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a checkpoint")
    with pytest.raises(EngineDeadError, match="failed to start"):
        AsyncEngine(_args(broken), process=True)


def test_child_exits_when_its_parent_is_killed(demo_dir, tmp_path) -> None:
    """A replica killed with SIGKILL (Ray does that) must not leave its engine running."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import sys, time\n"
        "from workers import AsyncEngine\n"
        "from workers.config import EngineArgs\n"
        f"eng = AsyncEngine(EngineArgs(model={str(demo_dir)!r}, kv_cache_memory_bytes=16 << 20),"
        " process=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(eng._core.pid))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[3])
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone(child), "the engine process outlived its parent"


def test_limits_come_from_the_child_after_it_sized_the_kv_cache(checkpoints) -> None:
    """The child caps max_model_len to its KV cache; the parent checks requests against that."""
    # The tiny mistral checkpoint's 16-token blocks are 8 KiB: 4 blocks, 64 tokens (of 512).
    tiny = EngineArgs(model=str(checkpoints["mistral"]), kv_cache_memory_bytes=32 * 1024)
    eng = AsyncEngine(tiny, process=True)
    try:
        assert eng.max_model_len == 64 and eng.input_checker.kv_cache_tokens == 64
        with pytest.raises(ValueError, match="capacity of 64 tokens"):
            eng.input_checker.check([5] * 10, SamplingParams(max_tokens=60))
    finally:
        eng.shutdown()
    with pytest.raises(EngineDeadError, match=r"max_model_len \(256\) is larger than the 64"):
        AsyncEngine(replace(tiny, max_model_len=256), process=True)


def test_hung_step_fails_every_stream_and_kills_the_child(demo_dir, monkeypatch) -> None:
    from workers.core.engine_child import TEST_STEP_SLEEP_ENV

    monkeypatch.setenv(TEST_STEP_SLEEP_ENV, "60")  # test hook: every step in the child hangs
    eng = AsyncEngine(replace(_args(demo_dir), step_timeout_s=0.5), process=True)
    stall = "no engine step completed in 0.5 s with work pending"
    try:
        assert eng.healthy  # idle: nothing pending, however long ago the last step was

        async def one(i: int) -> int:
            return len([o async for o in eng.generate(f"hang {i}", LONG, f"h{i}")])

        async def main():  # noqa: ANN202
            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)

        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) and stall in str(r) for r in results), results
        for check in (eng.check_progress, eng.check_health):
            with pytest.raises(EngineDeadError, match=stall):
                check()
        assert _wait_gone(eng._core.pid)  # the parent killed the stuck child
        assert_dead_for_good(eng, SamplingParams(max_tokens=4))
    finally:
        eng.shutdown()


def test_idle_child_never_trips_the_step_timeout(demo_dir) -> None:
    # 3 s: a busy machine can stretch the first steps past a second (a stall, wrongly).
    eng = AsyncEngine(replace(_args(demo_dir), step_timeout_s=3.0), process=True)

    async def one(rid: str):  # noqa: ANN202
        return [o async for o in eng.generate("idle", SamplingParams(max_tokens=8), rid)][-1]

    try:
        assert asyncio.run(one("i1")).finished
        time.sleep(4.0)  # idle past step_timeout_s: no work pending, so no stall
        eng.check_health()
        assert eng.healthy
        assert asyncio.run(one("i2")).finished
    finally:
        eng.shutdown()
