"""Async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host.

Its outputs must be the synchronous engine's (seeded sampling included, as
the sampler's noise depends only on seed and position), with every KV block back at the end;
the tokens a decode step reads before the host knows them come from the device."""

from __future__ import annotations

import random

import pytest

from tests.workers.parity import assert_outputs_match_hf
from workers import LLM, SamplingParams
from workers.config import EngineArgs
from workers.structured import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _requests() -> list[tuple[str, SamplingParams]]:
    """Every kind of request the engine serves, for one batch."""
    g = dict(temperature=0.0)
    return [
        ("Once upon a time", SamplingParams(max_tokens=24, ignore_eos=True, **g)),
        ("The weather today", SamplingParams(max_tokens=40, **g)),  # may stop at EOS
        ("A small cat", SamplingParams(max_tokens=1, **g)),
        ("In the morning", SamplingParams(max_tokens=30, stop=[" the", "."], **g)),
        ("She said", SamplingParams(max_tokens=20, logprobs=3, ignore_eos=True, **g)),
        ("He walked", SamplingParams(max_tokens=18, temperature=0.9, seed=7, ignore_eos=True)),
        ("They ran", SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=3, n=2)),
        ("It was", SamplingParams(max_tokens=12, prompt_logprobs=2, ignore_eos=True, **g)),
        ("The dog", SamplingParams(max_tokens=20, repetition_penalty=1.3, **g)),
        ("A bird", SamplingParams(max_tokens=14, min_tokens=10, seed=5, temperature=0.7)),
        (
            "Write a person:",
            SamplingParams(
                max_tokens=40,
                temperature=1.0,
                seed=8,
                structured_outputs=StructuredOutputs.from_schema(SCHEMA),
            ),
        ),
    ]


def _summary(outs) -> list:  # noqa: ANN001
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs
    ]


def _logprobs(outs) -> list:  # noqa: ANN001
    """Every logprob, flat: a step launched ahead may carry a row whose sequence just stopped,
    and a batch's shape moves a float's last bits (as between any two batches)."""
    rows = [lp for o in outs for c in o.outputs for lp in (c.logprobs or [])]
    rows += [lp for o in outs for lp in (o.prompt_logprobs or []) if lp]
    return [x for row in rows for item in sorted(row.items()) for x in item]


@pytest.fixture(scope="module")
def engines(demo_dir) -> dict[bool, LLM]:  # noqa: ANN001
    llms = {
        mode: LLM(
            str(demo_dir),
            kv_cache_memory_bytes=32 << 20,
            max_num_batched_tokens=64,
            async_scheduling=mode,
        )
        for mode in (False, True)
    }
    yield llms
    for llm in llms.values():
        llm.engine.shutdown()


HOST_BOUND = ("Write a person:",)  # a grammar: its steps wait (penalties run ahead)


@pytest.mark.parametrize("host_bound", [False, True], ids=["ahead", "with-host-bound"])
def test_async_steps_give_the_synchronous_outputs(engines, host_bound: bool) -> None:  # noqa: ANN001
    """Without the host-bound requests every step after the first runs ahead; with them the
    steps wait while they run, then run ahead again."""
    requests = [r for r in _requests() if host_bound or r[0] not in HOST_BOUND]
    prompts, params = zip(*requests, strict=True)
    expected = engines[False].generate(list(prompts), list(params), use_tqdm=False)
    got = engines[True].generate(list(prompts), list(params), use_tqdm=False)
    assert _summary(got) == _summary(expected)
    assert _logprobs(got) == pytest.approx(_logprobs(expected), abs=1e-5)
    engine = engines[True].engine
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.running


def test_steps_really_run_ahead_of_their_tokens(engines) -> None:  # noqa: ANN001
    engine = engines[True].engine
    worker = engine.executor.worker
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_prompt(f"ahead{i}", f"Story number {i}", params)
    ahead = 0
    while engine.has_unfinished():
        engine.step()
        # The step just launched computed with a token the host did not know yet.
        in_flight = engine._in_flight is not None
        pending = sum(s.num_pending for s in engine.seqs.values())
        # Two unknown tokens on the worker: the last step's, read on the device, and this one's.
        placeholders = sum(s.num_placeholders == 2 for s in worker.states.values())
        ahead += in_flight and pending == 3 and placeholders == 3
    assert ahead >= 8
    assert engine.block_manager.num_used_blocks == 0


def test_aborts_and_preemptions_while_a_step_is_in_flight(demo_dir) -> None:  # noqa: ANN001
    """A cache of a few blocks preempts; aborted requests drop their in-flight tokens; the
    survivors' outputs are the synchronous engine's and every block comes back."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = [f"Chapter {i} begins when" for i in range(6)]
    results = {}
    for mode in (False, True):
        llm = LLM(str(demo_dir), kv_cache_memory_bytes=1 << 19, block_size=8, async_scheduling=mode)
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_prompt(f"r{i}", p, params)
        steps = 0
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
            if steps == 5:
                engine.abort("r1")
                engine.abort("r4")
        assert engine.scheduler.num_preemptions > 0, "the cache was meant to preempt"
        assert engine.block_manager.num_used_blocks == 0
        results[mode] = done
        engine.shutdown()
    assert results[True] == results[False]
    assert "r1" not in results[True] and len(results[True]) == 4


def test_async_greedy_tokens_are_transformers(checkpoints) -> None:  # noqa: ANN001
    path = checkpoints["qwen3"]
    llm = LLM(
        str(path),
        kv_cache_memory_bytes=16 << 20,
        max_num_batched_tokens=32,
        async_scheduling=True,
    )
    rng = random.Random(4)
    vocab = llm.engine.vocab_size
    # Prompts chunked over several steps run beside decodes that read their tokens on-device.
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 19, 40, 66)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert_outputs_match_hf(path, prompts, outs, 10)
    llm.engine.shutdown()


def test_async_scheduling_needs_one_rank() -> None:
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size 1"):
        EngineArgs(async_scheduling=True, tensor_parallel_size=2).create_config()


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_no_step_runs_past_a_known_length(demo_dir, limit: str) -> None:  # noqa: ANN001
    """A sequence whose token in flight reaches max_tokens or max_model_len is not scheduled
    again: as many steps as synchronously, and no position past the model's length."""
    prompt = list(range(100, 120))
    max_tokens = 5 if limit == "max_tokens" else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    steps = {}
    for mode in (False, True):
        llm = LLM(
            str(demo_dir),
            kv_cache_memory_bytes=16 << 20,
            max_model_len=26 if limit == "max_model_len" else None,
            async_scheduling=mode,
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "length"
        steps[mode] = (llm.engine.num_steps, out.outputs[0].token_ids)
        llm.engine.shutdown()
    assert steps[True] == steps[False]


def test_a_reused_request_id_never_gets_its_predecessors_token(engines) -> None:  # noqa: ANN001
    """Aborted while its step is in flight, then sent again under the same id: the token the
    old sequence had coming is dropped, not appended to the new one."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = engines[False].generate(["A second life"], params, use_tqdm=False)[0]
    engine = engines[True].engine
    engine.add_prompt("again", "A first life", params)
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.abort("again")
    engine.add_prompt("again", "A second life", params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.block_manager.num_used_blocks == 0
