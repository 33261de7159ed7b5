"""AsyncEngine: concurrent streams, cancellation, failures that reach every caller, UTF-8.

The stream tests run on both engine cores; tests/workers/test_engine_process.py has what is
particular to the child process."""

from __future__ import annotations

import asyncio

import pytest

from tests.workers.failures import assert_dead_for_good
from tests.workers.scripted import make_scripted_checkpoint
from workers import LLM, AsyncEngine, SamplingParams
from workers.config import EngineArgs
from workers.errors import EngineDeadError

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["thread", "process"])
def engine(demo_dir, request):  # noqa: ANN001, ANN201
    """Both engine cores: a thread of this process, and a child process."""
    eng = AsyncEngine(
        EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=32 << 20), process=request.param
    )
    yield eng
    eng.shutdown()


async def _collect(engine: AsyncEngine, prompt: str, rid: str, cancel_after: int | None = None):
    deltas: list[str] = []
    ids: list[int] = []
    async for out in engine.generate(prompt, GREEDY, rid):
        deltas.append(out.outputs[0].delta_text)
        ids.extend(out.outputs[0].delta_token_ids)
        if cancel_after is not None and len(ids) >= cancel_after:
            break
    return "".join(deltas), ids, out


def test_64_streams_half_cancelled(engine: AsyncEngine, demo_dir) -> None:
    prompts = [f"stream number {i} says" for i in range(64)]
    expected = LLM(str(demo_dir), kv_cache_memory_bytes=32 << 20).generate(
        prompts, GREEDY, use_tqdm=False
    )

    async def main():  # noqa: ANN202
        tasks = [
            asyncio.create_task(
                _collect(engine, p, f"s{i}", cancel_after=3 if i % 4 == 1 else None)
            )
            for i, p in enumerate(prompts)
        ]
        # Cancel another quarter from outside, mid-flight.
        await asyncio.sleep(0.05)
        for i in range(3, 64, 4):
            tasks[i].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    for i, res in enumerate(results):
        if i % 2 == 0:
            text, ids, last = res
            assert last.finished and ids == expected[i].outputs[0].token_ids
            assert text == last.outputs[0].text == expected[i].outputs[0].text
    # Every cancelled or abandoned request gave its blocks back.
    for _ in range(100):
        s = engine.stats()
        if s.kv_blocks_used == 0 and s.num_requests_running == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert engine.stats().kv_blocks_used == 0
    assert engine.stats().num_requests_waiting == 0


def test_bad_input_raises_before_streaming(engine: AsyncEngine) -> None:
    async def main():  # noqa: ANN202
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in engine.generate("hi", SamplingParams(max_tokens=10**6), "bad"):
                pass
        text, ids, last = await _collect(engine, "still fine", "good")
        assert last.finished and len(ids) == 24

    asyncio.run(main())


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

    async def main():  # noqa: ANN202
        tasks = [asyncio.create_task(_collect(eng, f"p{i}", f"f{i}")) for i in range(16)]
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
        return done

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert_dead_for_good(eng, GREEDY)
    eng.shutdown()


@pytest.mark.parametrize("text", ["안녕하세요 세계 🌍🚀 kvray 👩‍👩‍👧", "날씨가 좋아요 🌞 and 🍕!"])
def test_korean_and_emoji_stream_cleanly(text: str, demo_dir, tmp_path) -> None:
    from workers.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(demo_dir)
    ids = tok.encode(text)
    start = 5  # a prompt token that is not in the text
    assert start not in ids and tok.decode(ids) == text
    path = make_scripted_checkpoint(tmp_path / "scripted", demo_dir, [start, *ids], eos=2)
    eng = AsyncEngine(EngineArgs(model=str(path), kv_cache_memory_bytes=4 << 20))

    async def main():  # noqa: ANN202
        deltas = []
        async for out in eng.generate(
            [start], SamplingParams(max_tokens=40, temperature=0.0), "utf8"
        ):
            deltas.append(out.outputs[0].delta_text)
        return deltas, out

    try:
        deltas, last = asyncio.run(main())
    finally:
        eng.shutdown()
    assert last.outputs[0].finish_reason == "stop"  # EOS after the script
    assert "".join(deltas) == last.outputs[0].text == text
    assert all("\ufffd" not in d for d in deltas)
    assert len([d for d in deltas if d]) >= 4  # it really streamed in pieces
