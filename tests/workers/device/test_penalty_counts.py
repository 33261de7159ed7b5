"""Penalised sequences' token tables on the device: the same tables `SamplingBatch.build`
makes from the token lists, read from the host once per sequence (not every step), right
after preemption, and counting tokens the host does not know yet under async scheduling."""

from __future__ import annotations

import random

import pytest
import torch

from workers import LLM, SamplingParams
from workers.device.layers.sampling_batch import SamplingBatch
from workers.device.model_runner import SeqState
from workers.device.penalty_counts import PenaltyCounts

VOCAB = 50
REP = SamplingParams(temperature=0.0, repetition_penalty=1.3)
FREQ = SamplingParams(temperature=0.0, frequency_penalty=0.5)


def _state(sid: str, params: SamplingParams, prompt: list[int], out: list[int]) -> SeqState:
    return SeqState(sid, len(prompt), prompt + out, params, [0], len(prompt) + len(out), 1)


def _expected(states: list[SeqState]) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch = SamplingBatch.build(
        [s.params for s in states],
        [s.token_ids[: s.prompt_len] for s in states],
        [s.token_ids[s.prompt_len :] for s in states],
        device="cpu",
        vocab_size=VOCAB,
    )
    return batch.output_counts, batch.prompt_mask


def test_tables_match_the_lists_through_growth_release_and_reuse() -> None:
    rng = random.Random(0)
    table = PenaltyCounts(VOCAB, torch.device("cpu"))
    states: dict[str, SeqState] = {}
    for step in range(40):
        if step % 7 == 3:  # a sequence leaves; its slot goes to the next newcomer
            gone = rng.choice(sorted(states))
            del states[gone]
            table.release(gone)
        for _ in range(rng.randrange(3)):  # newcomers, some with outputs (a resumed one)
            sid = f"s{step}-{len(states)}"
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
            out = [rng.randrange(VOCAB) for _ in range(rng.randrange(4))]
            states[sid] = _state(sid, rng.choice([REP, FREQ]), prompt, out)
        rows = list(states.values())
        rng.shuffle(rows)
        slot_t, counts, mask = table.tables(rows)
        want_counts, want_mask = _expected(rows)
        assert torch.equal(counts, want_counts)
        if want_mask is None:
            assert mask is None
        else:
            assert torch.equal(mask, want_mask)
        sampled = torch.randint(VOCAB, (len(rows) + 1,))  # a batch with one other row first
        table.record(slot_t, torch.arange(1, len(rows) + 1), sampled)
        for s, token in zip(rows, sampled[1:].tolist(), strict=True):
            s.token_ids.append(token)
    assert table.counts.shape[0] > 8  # it grew past its first slots


def test_a_first_step_with_unknown_tokens_is_an_error() -> None:
    s = _state("a", FREQ, [1, 2], [3])
    s.add_placeholder()
    with pytest.raises(RuntimeError, match="a: first penalised step with unknown tokens"):
        PenaltyCounts(VOCAB, torch.device("cpu")).tables([s])


def _check_counts(llm: LLM) -> None:
    """Every penalised sequence's counts on the device: its outputs the host knows, plus its
    tokens still in flight (sampled on the device, their values not back yet)."""
    engine = llm.engine
    table = engine.executor.worker.penalty_counts
    for sid, slot in table.slots.items():
        seq = engine.seqs.get(sid)
        if seq is None:  # finished: the worker lets it go with the next step
            continue
        outputs = torch.tensor(seq.output_token_ids, dtype=torch.long)
        extra = table.counts[slot] - torch.bincount(outputs, minlength=table.vocab_size)
        assert (extra >= 0).all() and extra.sum().item() == seq.num_pending


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_reads_no_output_tokens(demo_dir, async_scheduling: bool) -> None:  # noqa: ANN001
    """The tokens the host reads for a penalised row's tables do not grow with its output:
    all of them at its first sampling step, none after."""
    llm = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, async_scheduling=async_scheduling)
    engine, worker = llm.engine, llm.engine.executor.worker
    params = SamplingParams(
        max_tokens=60, temperature=0.8, seed=1, frequency_penalty=0.5, repetition_penalty=1.2,
        ignore_eos=True,
    )  # fmt: skip
    engine.add_prompt("p", "Once upon a time", params)
    read, ahead = [], 0
    while engine.has_unfinished():
        engine.step()
        if worker.penalty_counts is not None and worker.penalty_counts.slots:
            read.append(worker.penalty_counts.host_tokens_read)
            _check_counts(llm)
        # Penalised rows run ahead of their tokens too: two unknown tokens on the worker.
        ahead += any(s.num_placeholders == 2 for s in worker.states.values())
    assert len(read) >= 50 and set(read) == {read[0]}
    assert (ahead > 40) is async_scheduling
    engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_counts_are_rebuilt_after_preemption(demo_dir, async_scheduling: bool) -> None:  # noqa: ANN001
    llm = LLM(
        str(demo_dir),
        kv_cache_memory_bytes=1 << 19,
        block_size=8,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    penalties = [
        dict(frequency_penalty=0.7),
        dict(presence_penalty=1.0, repetition_penalty=1.3),
        dict(repetition_penalty=1.5),
    ]
    for i in range(6):
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, **penalties[i % 3])
        engine.add_prompt(f"r{i}", f"Chapter {i} begins when", params)
    while engine.has_unfinished():
        engine.step()
        _check_counts(llm)
        assert set(engine.executor.worker.penalty_counts.slots) <= set(
            engine.executor.worker.states
        )
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to preempt"
    worker = engine.executor.worker  # a row lives as long as the worker holds its sequence
    assert set(worker.penalty_counts.slots) <= set(worker.states)
    engine.shutdown()
