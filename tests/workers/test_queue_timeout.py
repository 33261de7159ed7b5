"""Queue timeouts in the engine: a request no step has taken by its deadline ends unrun
(`is_queue_timeout`), its blocks back; one a step has taken is never expired."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from workers import SamplingParams
from workers.config import EngineArgs
from workers.core.engine import LLMEngine
from workers.frontend.async_engine import AsyncEngine
from workers.outputs import RequestOutput, is_queue_timeout


@pytest.fixture(scope="module")
def engine(checkpoints: dict[str, Path]) -> LLMEngine:
    # One sequence per step: a second request waits for the first to finish.
    return LLMEngine.from_args(
        EngineArgs(model=str(checkpoints["llama"]), kv_cache_memory_bytes=1 << 20, max_num_seqs=1)
    )


def _add(engine: LLMEngine, rid: str, max_tokens: int, timeout: float | None) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    inp = engine.input_checker.check([1, 2, 3, 4, 5], params)
    engine.add_request(rid, inp, queue_timeout_s=timeout)


def _run(engine: LLMEngine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("the engine did not finish")


def test_a_request_still_waiting_at_its_deadline_ends_unrun(engine: LLMEngine) -> None:
    _add(engine, "first", max_tokens=8, timeout=0.05)
    _add(engine, "second", max_tokens=8, timeout=0.05)
    engine.step()  # takes "first" (one sequence per step); "second" waits
    time.sleep(0.1)
    done = _run(engine)
    assert not is_queue_timeout(done["first"])  # taken in time: runs to the end
    assert len(done["first"].outputs[0].token_ids) == 8
    second = done["second"]
    assert is_queue_timeout(second)
    assert second.outputs[0].finish_reason == "abort" and not second.outputs[0].token_ids
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests
    assert not engine._queue_deadlines


def test_no_timeout_waits_as_long_as_it_takes(engine: LLMEngine) -> None:
    _add(engine, "a", max_tokens=4, timeout=None)
    _add(engine, "b", max_tokens=4, timeout=None)
    engine.step()
    time.sleep(0.05)
    done = _run(engine)
    assert not any(is_queue_timeout(o) for o in done.values())


def test_async_engine_timeout_through_the_process_core(checkpoints: dict[str, Path]) -> None:
    """The deadline crosses the process boundary with the request (AddRequest)."""
    args = EngineArgs(
        model=str(checkpoints["llama"]), kv_cache_memory_bytes=1 << 20, max_num_seqs=1
    )

    async def main() -> list[RequestOutput]:
        engine = AsyncEngine(args, process=True)
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

            async def last(rid: str, timeout: float | None) -> RequestOutput:
                inp = engine.input_checker.check([1, 2, 3], params)
                out = None
                async for out in engine.generate_input(inp, rid, queue_timeout_s=timeout):  # noqa: B007
                    pass
                assert out is not None
                return out

            long = asyncio.create_task(last("long", None))
            await asyncio.sleep(0.2)  # "long" holds the only slot for 200 steps
            short = await last("short", 0.0)
            return [await long, short]
        finally:
            engine.shutdown()

    long, short = asyncio.run(main())
    assert not is_queue_timeout(long) and is_queue_timeout(short)
