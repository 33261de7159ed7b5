"""The engine core on a thread of this process: commands between steps, rejections through the
sink, and a step failure that reaches every caller (the child-process core's counterparts are
in tests/workers/frontend/test_engine_process.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.workers.failures import assert_dead_for_good, fail_while_streaming
from workers import AsyncEngine, RequestOutput, SamplingParams
from workers.config import EngineArgs
from workers.core.engine import LLMEngine
from workers.errors import EngineDeadError
from workers.frontend.engine_thread import EngineThread

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class RecordingSink:
    """A real OutputSink that keeps what the core delivers, for a test to wait on."""

    def __init__(self) -> None:
        self.outputs_seen: list[RequestOutput] = []
        self.rejections: list[tuple[str, Exception]] = []
        self.failures: list[BaseException] = []
        self.finished = threading.Event()

    def outputs(self, outs: list[RequestOutput]) -> None:
        self.outputs_seen.extend(outs)
        if any(o.finished for o in outs):
            self.finished.set()

    def rejected(self, request_id: str, err: Exception) -> None:
        self.rejections.append((request_id, err))

    def failed(self, cause: BaseException) -> None:
        self.failures.append(cause)


def test_commands_run_between_steps_and_rejections_reach_the_sink(demo_dir) -> None:
    engine = LLMEngine.from_args(EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20))
    core = EngineThread(engine)
    sink = RecordingSink()
    core.start(sink)
    try:
        inp = core.input_checker.check_prompt("a thread core", GREEDY, core.tokenizer)
        core.add("t1", inp)
        core.add("t1", inp)  # the id is in use: the engine refuses it, the sink hears why
        assert sink.finished.wait(30)
        assert [rid for rid, _ in sink.rejections] == ["t1"]
        assert isinstance(sink.rejections[0][1], ValueError)
        assert "already in use" in str(sink.rejections[0][1])
        last = sink.outputs_seen[-1]
        assert last.finished and len(last.outputs[0].token_ids) == 24
        assert sum(core.pop_step_token_counts()) >= len(inp.prompt_token_ids) + 23
        assert core.is_alive() and not sink.failures
    finally:
        core.shutdown()
    assert not core.is_alive()


def test_step_failure_reaches_every_caller(demo_dir) -> None:
    eng = AsyncEngine(EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20))
    calls = {"n": 0}
    real = eng.engine.executor.execute

    def flaky(step):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("injected model failure")
        return real(step)

    eng.engine.executor.execute = flaky

    async def one(i: int) -> int:
        n = 0
        async for out in eng.generate(f"p{i}", GREEDY, f"f{i}"):
            n += len(out.outputs[0].delta_token_ids)
        return n

    async def main():  # noqa: ANN202
        tasks = [asyncio.create_task(one(i)) for i in range(16)]
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert_dead_for_good(eng, GREEDY)
    with pytest.raises(EngineDeadError):
        eng.pop_step_token_counts()  # a command after the failure fails too, never hangs
    eng.shutdown()


HANG_TIMEOUT_S = 0.5  # tiny step_timeout_s, so a hung step is noticed at once
STALL = "no engine step completed in 0.5 s with work pending"


def test_hung_step_fails_every_stream_and_the_health_check(demo_dir) -> None:
    eng = AsyncEngine(
        EngineArgs(
            model=str(demo_dir), kv_cache_memory_bytes=16 << 20, step_timeout_s=HANG_TIMEOUT_S
        )
    )
    hang, release = threading.Event(), threading.Event()
    real = eng.engine.executor.execute

    def hanging(step):  # noqa: ANN001, ANN202 - fault injection: a forward pass that never ends
        if hang.is_set():
            release.wait(60)
        return real(step)

    eng.engine.executor.execute = hanging
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        results = fail_while_streaming(eng, params, hang.set)
        assert all(isinstance(r, EngineDeadError) and STALL in str(r) for r in results), results
        for check in (eng.check_progress, eng.check_health):
            with pytest.raises(EngineDeadError, match=STALL):
                check()
        assert not eng.healthy
        assert_dead_for_good(eng, GREEDY)
    finally:
        release.set()  # the abandoned step returns; the loop sees the engine is dead and stops
        eng.shutdown()


def test_idle_engine_never_trips_the_step_timeout(demo_dir) -> None:
    eng = AsyncEngine(
        EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20, step_timeout_s=1.0)
    )

    async def one(rid: str) -> RequestOutput:
        return [o async for o in eng.generate("idle", GREEDY, rid)][-1]

    try:
        assert asyncio.run(one("i1")).finished
        time.sleep(2.0)  # idle far past step_timeout_s: no work pending, so no stall
        eng.check_health()
        assert eng.healthy
        assert asyncio.run(one("i2")).finished
    finally:
        eng.shutdown()
