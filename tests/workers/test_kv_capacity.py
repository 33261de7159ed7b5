"""KV capacity is a first-class limit: max_model_len fits the cache, a request that can never
fit is refused naming it, a sequence that outgrows the cache finishes instead of looping, and
random workloads on a tiny cache always end with every block back."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers import LLM, SamplingParams
from workers.config import EngineArgs, SchedulerConfig
from workers.core.block_manager import BlockManager
from workers.core.engine import LLMEngine
from workers.core.request import Seq
from workers.core.scheduler import Scheduler
from workers.inputs import InputChecker
from workers.outputs import RequestOutput

# The tiny mistral checkpoint (tests/checkpoints.py): 2 layers, 1 KV head of 32 floats, so one
# token of KV is 2 * 2 * 32 * 4 = 512 bytes and a 4-token block 2 KiB. Its steps take about a
# millisecond on a CPU, which keeps the property test fast.
BLOCK_SIZE = 4
NUM_BLOCKS = 24
CAPACITY = NUM_BLOCKS * BLOCK_SIZE  # 96 tokens
TINY_KV = EngineArgs(
    kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_SIZE * 512,
    block_size=BLOCK_SIZE,
    max_num_batched_tokens=16,  # chunked prefill on
    max_num_seqs=6,
)


def _engine(model: Path, **kw) -> LLMEngine:  # noqa: ANN003
    engine = LLMEngine.from_args(replace(TINY_KV, model=str(model), **kw))
    assert engine.block_manager.num_blocks == NUM_BLOCKS
    return engine


def _lift_max_model_len(engine: LLMEngine, limit: int) -> LLMEngine:
    """An engine whose max_model_len exceeds its KV cache, as the cap at start-up prevents:
    the only way to reach the scheduler's last resort (a sequence larger than the cache)."""
    engine.config = replace(
        engine.config, scheduler=replace(engine.config.scheduler, max_model_len=limit)
    )
    engine.input_checker = InputChecker(engine.vocab_size, limit)
    return engine


def _assert_all_blocks_back(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} blocks still held"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.requests and not engine.seqs


# -- start-up --------------------------------------------------------------------------------


def test_default_max_model_len_is_capped_to_the_cache_with_a_warning(checkpoints, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="workers.config"):
        engine = _engine(checkpoints["mistral"])
    assert engine.max_model_len == CAPACITY  # the checkpoint says 512
    assert engine.input_checker.max_model_len == CAPACITY
    assert engine.input_checker.kv_cache_tokens == CAPACITY
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "max_model_len 512" in warning and f"{CAPACITY} tokens the KV cache" in warning
    assert "kv_cache_memory_bytes" in warning  # how to raise it


def test_max_model_len_that_fits_is_left_alone(checkpoints) -> None:
    engine = _engine(checkpoints["mistral"], max_model_len=64)
    assert engine.max_model_len == 64 and engine.input_checker.kv_cache_tokens == CAPACITY


def test_explicit_max_model_len_beyond_the_cache_is_an_error(checkpoints) -> None:
    with pytest.raises(ValueError, match=rf"max_model_len \(200\).* {CAPACITY} tokens the KV"):
        _engine(checkpoints["mistral"], max_model_len=200)


# -- requests that can never fit -------------------------------------------------------------


def test_issue_case_is_refused_naming_the_capacity_then_a_fitting_one_runs(demo_dir) -> None:
    # The reported case: 1 MiB of KV is 16 blocks of 16 tokens for the demo model.
    llm = LLM(str(demo_dir), kv_cache_memory_bytes=1 << 20)
    assert llm.engine.max_model_len == 256
    prompt = [5 + i % 50 for i in range(100)]
    with pytest.raises(ValueError, match=r"^max_tokens \(600\).*capacity of 256 tokens"):
        llm.generate([prompt], SamplingParams(max_tokens=600, ignore_eos=True), use_tqdm=False)
    [out] = llm.generate(
        [prompt], SamplingParams(max_tokens=156, ignore_eos=True, n=2), use_tqdm=False
    )
    assert [len(c.token_ids) for c in out.outputs] == [156, 156]
    assert {c.finish_reason for c in out.outputs} == {"length"}
    _assert_all_blocks_back(llm.engine)


def test_prompt_of_the_whole_cache_is_refused(checkpoints) -> None:
    engine = _engine(checkpoints["mistral"])
    with pytest.raises(ValueError, match=rf"^prompt is {CAPACITY} tokens.*capacity of {CAPACITY}"):
        engine.add_prompt("r", [7] * CAPACITY, SamplingParams(max_tokens=1))


# -- a sequence that outgrows the cache ---------------------------------------------------------


def _drain(engine: LLMEngine, max_steps: int) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    raise AssertionError(f"still running after {max_steps} steps")


def test_sequence_larger_than_the_cache_finishes_with_length(checkpoints) -> None:
    engine = _lift_max_model_len(_engine(checkpoints["mistral"]), 512)
    params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0)
    for i in range(3):  # they compete: the younger ones are preempted while the oldest grows
        engine.add_prompt(f"r{i}", [10 + i + k for k in range(30)], params)
    done = _drain(engine, max_steps=3 * (30 + 300) + 10)
    for out in done.values():
        [c] = out.outputs
        assert c.finish_reason == "length"
        # It ran until the cache was full: every computed token had a slot, the last one
        # sampled had none left.
        assert 30 + len(c.token_ids) == CAPACITY + 1
    assert engine.scheduler.num_preemptions > 0
    _assert_all_blocks_back(engine)


# -- the property: random workloads always end ---------------------------------------------------


@dataclass(frozen=True)
class Job:
    prefix: int  # index of a shared prompt prefix, or -1 for none
    suffix_len: int
    max_tokens: int | None
    n: int
    ignore_eos: bool
    seeded: bool  # temperature 1 with a seed, else greedy
    arrival: int  # engine step at which it arrives
    abort_after: int | None  # steps after arrival at which the client gives up


PREFIXES = [[100 + 7 * i + k for k in range(length)] for i, length in enumerate((8, 21, 40))]

JOBS = st.lists(
    st.builds(
        Job,
        prefix=st.integers(-1, len(PREFIXES) - 1),
        suffix_len=st.integers(1, 40),
        max_tokens=st.one_of(st.none(), st.integers(1, 120)),
        n=st.integers(1, 3),
        ignore_eos=st.booleans(),
        seeded=st.booleans(),
        arrival=st.integers(0, 30),
        abort_after=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 20)),
    ),
    min_size=1,
    max_size=10,
)


@pytest.fixture(scope="module")
def engines(checkpoints) -> dict[str, LLMEngine]:
    """One engine as configured (max_model_len capped to the cache) and one past the cap; the
    tests leave them idle with every block free, so hypothesis examples can share them."""
    return {
        "capped": _engine(checkpoints["mistral"]),
        "lifted": _lift_max_model_len(_engine(checkpoints["mistral"]), 512),
    }


_WORKLOADS = itertools.count()


def _prompt(job: Job, i: int) -> list[int]:
    prefix = PREFIXES[job.prefix] if job.prefix >= 0 else []
    return prefix + [300 + (i * 13 + k) % 500 for k in range(job.suffix_len)]


def _run_workload(engine: LLMEngine, jobs: list[Job], tag: str) -> None:
    limit = engine.max_model_len
    # An upper bound on the steps (see workers/core/scheduler.py): every step the oldest running
    # sequence computes a token or finishes, it stays the oldest until it finishes, and it
    # computes at most its final length meanwhile (the recompute after a preemption included).
    # A step with nothing running admits a sequence (which then is the oldest) or finishes one.
    bound = max(j.arrival for j in jobs) + 2
    for i, job in enumerate(jobs):
        length = len(_prompt(job, i)) + (job.max_tokens or limit)
        bound += job.n * (min(length, CAPACITY + 1) + 2)
    added: dict[str, tuple[Job, list[int]]] = {}
    done: dict[str, RequestOutput] = {}
    steps = 0
    for t in range(bound + 1):
        for i, job in enumerate(jobs):
            rid = f"{tag}-{i}"
            if job.arrival == t:
                prompt = _prompt(job, i)
                params = SamplingParams(
                    max_tokens=job.max_tokens,
                    n=job.n,
                    ignore_eos=job.ignore_eos,
                    temperature=1.0 if job.seeded else 0.0,
                    seed=i if job.seeded else None,
                )
                try:
                    engine.add_prompt(rid, prompt, params)
                except ValueError as err:
                    # Refused only when it cannot fit, naming the limit; it runs nothing.
                    assert len(prompt) + (job.max_tokens or 1) > limit, err
                    if limit == CAPACITY:
                        assert f"capacity of {CAPACITY} tokens" in str(err)
                    continue
                added[rid] = (job, prompt)
            if job.abort_after is not None and t == job.arrival + job.abort_after:
                out = engine.abort(rid)
                if out is not None:
                    done[rid] = out
        if engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
        elif t > max(j.arrival for j in jobs):
            break
    assert not engine.has_unfinished(), f"still running after {steps} steps (bound {bound})"
    assert steps <= bound
    assert done.keys() == added.keys()
    for rid, (job, prompt) in added.items():
        out = done[rid]
        assert out.finished and len(out.outputs) == job.n
        for c in out.outputs:
            if c.finish_reason == "abort":
                assert job.abort_after is not None
                continue
            assert c.finish_reason in ("stop", "length"), c.finish_reason
            if c.finish_reason == "stop":
                assert not job.ignore_eos
            if job.max_tokens is not None:
                assert len(c.token_ids) <= job.max_tokens
            # Never more than the cache held, plus the one token sampled from a full cache.
            assert len(prompt) + len(c.token_ids) <= min(limit, CAPACITY + 1)
    _assert_all_blocks_back(engine)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(jobs=JOBS, lifted=st.booleans())
def test_random_workloads_on_a_tiny_cache_always_end(engines, jobs, lifted) -> None:  # noqa: ANN001
    engine = engines["lifted" if lifted else "capped"]
    _run_workload(engine, jobs, tag=f"w{next(_WORKLOADS)}")


# -- the scheduler's last resort, on its own ------------------------------------------------------


def _sched(num_blocks: int = 4) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    return Scheduler(SchedulerConfig(max_model_len=512, max_num_batched_tokens=64), bm), bm


def _seq(name: str, prompt_len: int, num_outputs: int = 0) -> Seq:
    prompt = [1000 + len(name) * 97 + k for k in range(prompt_len)]
    seq = Seq(name, name, 0, prompt, SamplingParams())
    seq.token_ids.extend(range(2000, 2000 + num_outputs))  # as if preempted after sampling
    return seq


def test_waiting_sequence_larger_than_the_cache_is_finished_at_once() -> None:
    sched, bm = _sched()  # 16 tokens
    small, big = _seq("small", 5), _seq("big", 10, num_outputs=7)  # big: 17 tokens
    sched.add(small)
    sched.add(big)
    out = sched.schedule()
    # big never fits: it ends now, even while small still runs, instead of waiting for ever.
    assert out.out_of_cache == [big] and [s for s, _ in out.scheduled] == [small]
    assert big.finished and not big.block_ids and list(sched.waiting) == []
    sched.remove(small)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_running_sequence_that_outgrows_the_cache_is_finished_not_preempted() -> None:
    sched, bm = _sched()
    old, young = _seq("old", 12), _seq("young", 3)
    sched.add(old)
    sched.add(young)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [old, young] and bm.num_free_blocks == 0
    for seq, n in out.scheduled:  # as the engine does after the step: one token sampled
        seq.num_computed_tokens += n
        seq.token_ids.append(5)
    old.token_ids.extend([6, 7, 8, 9])  # 17 tokens: more than the whole cache
    out = sched.schedule()
    # old ends without preempting young, which goes on decoding.
    assert out.out_of_cache == [old] and not out.preempted
    assert [s for s, _ in out.scheduled] == [young]
    sched.remove(young)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
