"""The triton backend's step inputs: the same ids, positions, KV slots and logits rows as the
torch path's, in one buffer; decode steps padded to a graph's size at the graph's addresses."""

from __future__ import annotations

import pytest
import torch

from workers.device.decode_graphs import _idle_step
from workers.device.model_runner import SeqState, prepare_inputs
from workers.device.step_buffers import StepBuffers
from workers.device.triton_inputs import (
    DecodePadding,
    buffer_capacity,
    prepare_triton_inputs,
    table_width,
    triton_layout,
)
from workers.sampling_params import SamplingParams

BS = 4


def _state(sid: str, prompt: int, computed: int, scheduled: int, out: int = 0) -> SeqState:
    tokens = list(range(100 + prompt + out))
    blocks = list(range(10 * int(sid[1:]), 10 * int(sid[1:]) + -(-(computed + scheduled) // BS)))
    return SeqState(sid, prompt, tokens, SamplingParams(), blocks, computed, scheduled)


def _batch() -> list[SeqState]:
    # Two decodes (one a block's last slot), a fresh prefill, a chunk over a cached prefix that
    # ends before the prompt does (no sample), and a last chunk.
    return [
        _state("s1", 5, 5, 1, out=1),
        _state("s2", 7, 7, 1, out=1),
        _state("s3", 9, 0, 9),
        _state("s4", 20, 8, 6),
        _state("s5", 11, 4, 7),
    ]


def _fix_lengths(states: list[SeqState]) -> list[SeqState]:
    for s in states:  # the tokens a sequence holds: its prompt, then what it generated
        del s.token_ids[s.prompt_len + (1 if s.num_scheduled == 1 else 0) :]
    return states


def test_same_inputs_as_the_torch_path() -> None:
    states = _fix_lengths(_batch())
    buffers = StepBuffers(buffer_capacity(64, 8, 16), torch.device("cpu"))
    ours = prepare_triton_inputs(states, BS, 2, buffers)
    ref = prepare_inputs(states, BS, torch.device("cpu"))
    assert ours.input_ids.tolist() == ref.input_ids.tolist()
    assert ours.positions.tolist() == ref.positions.tolist()
    assert ours.meta.slot_mapping.tolist() == ref.meta.slot_mapping.tolist()
    assert ours.logits_indices.tolist() == ref.logits_indices.tolist()
    assert [s.seq_id for s in ours.sample_states] == [s.seq_id for s in ref.sample_states]
    assert [s.seq_id for s in ours.sample_states] == ["s1", "s2", "s3", "s5"]
    t = ours.meta.triton
    assert t.graph_size == 0 and ours.meta.num_decodes == 2
    assert t.real_rows.tolist() == [1] * 24
    assert t.seq_lens.tolist() == [6, 8, 9, 14, 11]
    assert t.cu_seqlens_q.tolist() == [0, 1, 2, 11, 17, 24]
    for r, s in enumerate(states):
        assert t.block_tables[r, : len(s.block_ids)].tolist() == s.block_ids
    # Every piece is a view of the one buffer: the step moved in one copy.
    base = buffers.dev.data_ptr()
    end = base + buffers.capacity * 8
    for x in (ours.input_ids, ours.positions, ours.logits_indices, t.block_tables, t.prog_seq):
        assert base <= x.data_ptr() < end


def test_a_decode_step_is_padded_to_the_graphs_layout() -> None:
    width = table_width(64, BS, 1000)
    buffers = StepBuffers(buffer_capacity(64, 8, width), torch.device("cpu"))
    padding = DecodePadding((1, 2, 4, 8), width)
    # What a capture of size 4 reads; the buffer then holds a stale step of larger numbers.
    _, _, graph_meta = _idle_step(buffers, 4, width, 2)
    prepare_triton_inputs(_fix_lengths(_batch()), BS, 2, buffers)
    states = _fix_lengths(_batch()[:2] + [_state("s6", 3, 3, 1, out=1)])
    inp = prepare_triton_inputs(states, BS, 2, buffers, padding)
    t = inp.meta.triton
    assert t.graph_size == 4 and inp.meta.num_decodes == 3
    expected = buffers.device_views(triton_layout(4, 4, 4, width, 0))
    got = [inp.input_ids, inp.positions, inp.meta.slot_mapping, t.real_rows, t.seq_lens,
           t.cu_seqlens_q, t.prog_seq, t.prog_qoff, t.block_tables]  # fmt: skip
    for g, e in zip(got, expected[:9], strict=True):
        assert (g.data_ptr(), g.shape) == (e.data_ptr(), e.shape)
    assert graph_meta.triton.block_tables.data_ptr() == t.block_tables.data_ptr()
    # Padding rows: token 0 at position 0, no slot, no query, no context.
    assert inp.input_ids.tolist()[3:] == [0] and inp.positions.tolist() == [5, 7, 3, 0]
    assert inp.meta.slot_mapping.tolist()[3] == -1 and t.real_rows.tolist() == [1, 1, 1, 0]
    assert t.seq_lens.tolist() == [6, 8, 4, 0]
    assert t.cu_seqlens_q.tolist() == [0, 1, 2, 3, 3]
    assert t.prog_seq.tolist() == [0, 1, 2, 3] and t.prog_qoff.tolist() == [0, 0, 0, 0]
    assert inp.logits_indices.tolist() == [0, 1, 2]
    # Larger than every graph, or with a prefill: not padded.
    many = _fix_lengths([_state(f"s{i}", 3, 3, 1, out=1) for i in range(1, 10)])
    assert prepare_triton_inputs(many, BS, 2, buffers, padding).meta.triton.graph_size == 0
    mixed = _fix_lengths(_batch())
    assert prepare_triton_inputs(mixed, BS, 2, buffers, padding).meta.triton.graph_size == 0


def test_capacity_covers_the_largest_step_and_a_larger_one_is_refused() -> None:
    width = table_width(4096, 16, 100)
    assert width == 100  # not more columns than the cache has blocks
    assert table_width(4096, 16, 10**6) == 256
    cap = buffer_capacity(32, 4, width)
    states = [_state(f"s{i}", 8, 0, 8) for i in range(1, 5)]
    for s in states:
        s.params = SamplingParams(prompt_logprobs=1)
    buffers = StepBuffers(cap, torch.device("cpu"))
    inp = prepare_triton_inputs(_fix_lengths(states), BS, 1, buffers)
    assert len(inp.logits_indices) == 4 + 4 * 7  # samples, then prompt logprob rows
    small = StepBuffers(40, torch.device("cpu"))
    with pytest.raises(ValueError, match="integers of metadata"):
        prepare_triton_inputs(_fix_lengths([_state("s1", 8, 0, 8)]), BS, 1, small)
