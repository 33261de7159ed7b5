"""AsyncEngine: concurrent streams, cancellation, output kinds, bad input, UTF-8.

The stream tests run on both engine cores and check that both give the same outputs;
tests/workers/frontend/test_engine_thread.py and tests/workers/frontend/test_engine_process.py have
what is
particular to each core (failures among it)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.workers.scripted import make_scripted_checkpoint
from workers import LLM, AsyncEngine, RequestOutput, RequestOutputKind, SamplingParams
from workers.config import EngineArgs
from workers.core.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(
    scope="module",
    params=[(False, False), (True, False), (True, True)],
    ids=["thread", "process", "process-async"],
)
def engine(demo_dir, request):  # noqa: ANN001, ANN201
    """Both engine cores: a thread of this process, and a child process; the child also with
    async scheduling (its steps launched ahead of their tokens), as a replica runs it."""
    process, async_scheduling = request.param
    args = EngineArgs(
        model=str(demo_dir), kv_cache_memory_bytes=32 << 20, async_scheduling=async_scheduling
    )
    eng = AsyncEngine(args, process=process)
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


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ("hi", {"max_tokens": 10**6}, "max_tokens"),
        ([1, 10**9], {}, "prompt token id"),
        ("", {}, "prompt"),
    ],
)
def test_bad_input_raises_before_streaming(engine: AsyncEngine, prompt, kwargs, field) -> None:  # noqa: ANN001
    async def main():  # noqa: ANN202
        with pytest.raises(ValueError, match=field):
            async for _ in engine.generate(prompt, SamplingParams(**kwargs), "bad"):
                pass
        text, ids, last = await _collect(engine, "still fine", "good")
        assert last.finished and len(ids) == 24

    asyncio.run(main())


def test_generate_input_trusts_a_checked_request(engine: AsyncEngine) -> None:
    inp = engine.input_checker.check_prompt("checked once", GREEDY, engine.tokenizer)

    async def main():  # noqa: ANN202
        return [o async for o in engine.generate_input(inp, "checked")]

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].prompt == "checked once"
    assert outs[-1].prompt_token_ids == list(inp.prompt_token_ids)
    assert len(outs[-1].outputs[0].token_ids) == 24


# A request that exercises every output field: two samples that finish at different steps
# (a stop string for one of them is likely, max_tokens for the other), seeded sampling,
# logprobs.
KIND_PARAMS = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=11, logprobs=2, stop=["e"])


def _summary(out: RequestOutput) -> tuple:
    """Everything of an output but its timings."""
    return (
        out.request_id,
        out.prompt,
        out.prompt_token_ids,
        out.finished,
        out.num_cached_tokens,
        out.metrics is not None,
        [
            (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
            + (c.delta_text, c.delta_token_ids, c.delta_logprobs)
            for c in out.outputs
        ],
    )


@pytest.fixture(scope="module")
def reference_engines(demo_dir):  # noqa: ANN001, ANN201
    """The offline engine, synchronous and with async scheduling: a step launched ahead may
    hold a row whose sequence has just stopped, and a batch's shape changes a logprob's last
    bits, so each core is compared with the engine scheduling as it does."""
    engines = {
        a: LLMEngine.from_args(
            EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=32 << 20, async_scheduling=a)
        )
        for a in (False, True)
    }
    yield engines
    for eng in engines.values():
        eng.shutdown()


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_both_cores_give_the_engine_outputs_of_the_kind_asked(
    engine: AsyncEngine, reference_engines: dict, kind: RequestOutputKind, request
) -> None:
    reference_engine = reference_engines[request.node.callspec.params["engine"][1]]
    params = dataclasses.replace(KIND_PARAMS, output_kind=kind)
    prompt = f"the kind {kind.value} asks for"
    reference_engine.add_prompt(f"k-{kind.value}", prompt, params)
    expected = []
    while reference_engine.has_unfinished():
        expected.extend(reference_engine.step())

    async def main():  # noqa: ANN202
        return [o async for o in engine.generate(prompt, params, f"k-{kind.value}")]

    outs = asyncio.run(main())
    assert [_summary(o) for o in outs] == [_summary(o) for o in expected]
    running, last = outs[:-1], outs[-1]
    if kind is RequestOutputKind.FINAL_ONLY:
        assert running == []
    else:
        assert running  # one per step until the last sample finished
        for o in running:  # nothing cumulative while running
            assert not o.finished and o.prompt is None and o.prompt_token_ids == []
            assert all(c.text == "" and c.token_ids == [] and c.logprobs is None for c in o.outputs)
    assert last.finished and last.metrics is not None and last.prompt == prompt
    for c in last.outputs:
        streamed = [
            t for o in outs for d in o.outputs if d.index == c.index for t in d.delta_token_ids
        ]
        text = "".join(d.delta_text for o in outs for d in o.outputs if d.index == c.index)
        lps = [x for o in outs for d in o.outputs if d.index == c.index for x in d.delta_logprobs]
        assert c.token_ids == streamed and c.text == text and c.logprobs == lps
        assert c.finish_reason in ("stop", "length")


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


def test_generate_never_makes_the_full_health_check(demo_dir) -> None:
    """Per request only the cheap local check runs: the full one (TP > 1: a blocking ping of
    every rank) would stall every stream on the caller's event loop."""
    eng = AsyncEngine(EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20))
    pings: list[int] = []
    eng.engine.executor.check_health = lambda: pings.append(1)  # counts the full checks

    async def main():  # noqa: ANN202
        return [(await _collect(eng, f"p{i}", f"c{i}"))[2] for i in range(3)]

    try:
        assert all(out.finished for out in asyncio.run(main()))
        assert pings == []
        eng.check_health()  # the health hook's full check still reaches the executor
        assert pings == [1]
    finally:
        eng.shutdown()


def test_priority_crosses_to_the_engine_child(demo_dir) -> None:
    """One sequence at a time: while a long request runs, a less urgent and then a more
    urgent one queue; the urgent one runs first."""
    eng = AsyncEngine(
        EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=32 << 20, max_num_seqs=1),
        process=True,
    )
    finished: list[str] = []

    async def run(rid: str, priority: int, max_tokens: int, started=None) -> None:  # noqa: ANN001
        params = dataclasses.replace(GREEDY, max_tokens=max_tokens)
        async for out in eng.generate(f"request {rid}", params, rid, priority=priority):
            if started is not None:
                started.set()
            if out.finished:
                finished.append(rid)

    async def main() -> None:
        started = asyncio.Event()
        first = asyncio.create_task(run("long", 0, 300, started))
        await started.wait()  # "long" is running: the others queue behind it
        await asyncio.gather(first, run("later", 3, 4), run("urgent", -3, 4))

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
    assert finished == ["long", "urgent", "later"]
