"""The attention kernels (`kvray::paged_decode_attention`, `kvray::paged_prefill_attention`)
against SDPA over the same gathered K/V, and the batch layout that routes rows to them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.workers.device.layers.cpu_kernels.helpers import BLOCK
from workers.device.layers.cpu_kernels import (
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
)


def _reference(q, k_cache, v_cache, tables, lens, scale):
    kd = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [D, KH, L, Dh]
    vd = v_cache[tables].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(kd.shape[2])[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2).double(),
        kd.double(),
        vd.double(),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2).float()


@pytest.mark.parametrize(
    ("num_seqs", "heads", "kv_heads", "head_dim"),
    [
        (40, 4, 2, 64),  # the demo model's shape, a task per sequence
        (3, 4, 2, 64),  # few sequences: a task per KV head
        (20, 16, 8, 128),  # Qwen3-0.6B's shape
        (17, 10, 2, 32),  # no specialised shape: the generic loop
        (32, 12, 4, 64),  # the 100M checkpoint's shape
        (5, 3, 3, 48),  # no grouping
    ],
)
def test_matches_sdpa_over_the_gathered_context(lib, num_seqs, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_seqs * heads + head_dim)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen)
    # Lengths at and around block edges, one token, and a long context.
    edges = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 97]
    lens = torch.tensor([edges[i % len(edges)] for i in range(num_seqs)], dtype=torch.int64)
    max_blocks = -(-int(lens.max()) // BLOCK)
    tables = torch.randint(0, num_blocks, (num_seqs, max_blocks), generator=gen)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen) * 3  # peaked softmax too
    scale = head_dim**-0.5

    out = paged_decode_attention_cpu(lib, q, k_cache, v_cache, tables, lens, scale)

    torch.testing.assert_close(
        out, _reference(q, k_cache, v_cache, tables, lens, scale), atol=2e-5, rtol=1e-4
    )


def _chunk_reference(q, k_cache, v_cache, table, pos0, scale):
    """Causal SDPA (float64) of a chunk's queries, token i at position pos0 + i, over its
    sequence's first pos0 + n tokens gathered through its block table."""
    n = q.shape[0]
    t = torch.arange(pos0 + n)
    slots = table[t // BLOCK] * BLOCK + t % BLOCK
    k = k_cache.flatten(0, 1)[slots].transpose(0, 1).double()  # [KH, ctx, Dh]
    v = v_cache.flatten(0, 1)[slots].transpose(0, 1).double()
    mask = t[None, :] <= (pos0 + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1).float()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (4, 2, 64),  # the demo model's shape
        (12, 4, 64),  # the 100M checkpoint's: 21 query tokens x 3 heads per task
        (16, 8, 128),  # Qwen3-0.6B's
        (8, 1, 128),  # 8 query heads per KV head
        (6, 6, 80),  # no grouping, a head dim with no specialised path
        (96, 1, 32),  # more query heads per KV head than a task's rows: a token per task
    ],
)
def test_prefill_kernel_matches_causal_sdpa_over_the_paged_context(
    tiled_lib, heads, kv_heads, head_dim
):
    gen = torch.Generator().manual_seed(heads * head_dim)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen)
    # (length, first position): one token, block and key-tile edges, a computed prefix,
    # and chunks longer than a task's query block.
    specs = [(1, 0), (5, 0), (16, 0), (17, 3), (33, 40), (100, 7), (40, 0), (3, 150)]
    first = 3  # rows before the chunks (decodes): the kernel leaves them alone
    rows = first + sum(n for n, _ in specs)
    q = torch.randn(rows, heads, head_dim, generator=gen) * 3  # peaked softmax too
    tables = torch.zeros(rows, 12, dtype=torch.int64)
    chunks, row = [], first
    for n, pos0 in specs:
        blocks = torch.randperm(num_blocks, generator=gen)[: -(-(pos0 + n) // BLOCK)]
        tables[row : row + n, : len(blocks)] = blocks
        chunks.append((row, n, pos0))
        row += n
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5

    paged_prefill_attention_cpu(
        tiled_lib, q, k_cache, v_cache, tables, torch.tensor(chunks), out, scale
    )

    assert out[:first].isnan().all()
    for row, n, pos0 in chunks:
        expected = _chunk_reference(q[row : row + n], k_cache, v_cache, tables[row], pos0, scale)
        torch.testing.assert_close(out[row : row + n], expected, atol=2e-5, rtol=1e-4)


def test_prefill_kernel_refuses_head_dims_it_does_not_take(tiled_lib):
    q = torch.randn(4, 2, 72)  # 72: a multiple of AVX2's 8 lanes, refused there too
    cache = torch.zeros(2, BLOCK, 2, 72)
    with pytest.raises(RuntimeError, match="head_dim 72"):
        paged_prefill_attention_cpu(
            tiled_lib,
            q,
            cache,
            cache,
            torch.zeros(4, 1, dtype=torch.int64),
            torch.tensor([[0, 4, 0]]),
            torch.empty_like(q),
            0.1,
        )


def test_prefill_chunks_follow_the_decodes_short_contexts_as_rows(wide_lib):
    from workers.device.model_runner import PREFILL_KERNEL_MIN_CONTEXT, SeqState, prepare_inputs
    from workers.sampling_params import SamplingParams

    def state(name: str, length: int, computed: int, scheduled: int, blocks: list[int]):
        s = SeqState(name, length, list(range(length)), SamplingParams(), blocks)
        s.num_computed_tokens, s.num_scheduled = computed, scheduled
        return s

    assert PREFILL_KERNEL_MIN_CONTEXT == 64
    long = state("long", 136, 120, 16, list(range(10, 19)))  # context 136: prefill kernel
    fresh = state("fresh", 20, 0, 20, [7, 8])  # context 20: a row per token
    decode = state("decode", 31, 30, 1, [1, 2])  # position 30 of a 31-token sequence
    cached = state("cached", 40, 32, 8, [3, 4, 5])  # 32 cached tokens, 8 to compute
    inp = prepare_inputs([long, fresh, decode, cached], BLOCK, torch.device("cpu"), wide_lib)
    meta = inp.meta
    assert (meta.num_decodes, meta.num_row_kernel_rows, meta.num_kernel_rows) == (1, 29, 45)
    assert meta.prefills == []
    assert meta.prefill_chunks.tolist() == [[29, 16, 120]]  # first row, length, position
    assert meta.decode_lens.tolist() == [31, *range(1, 21), *range(33, 41), *range(121, 137)]
    pad = [0] * 6
    assert (
        meta.decode_block_tables.tolist()
        == ([[1, 2, *pad, 0]] + [[7, 8, *pad, 0]] * 20 + [[3, 4, 5, *pad]] * 8)
        + [list(range(10, 19))] * 16
    )
    assert inp.positions.tolist() == [30, *range(20), *range(32, 40), *range(120, 136)]
    assert [s.seq_id for s in inp.sample_states] == ["decode", "fresh", "cached", "long"]
    assert inp.logits_indices.tolist() == [0, 20, 28, 44]

    torch_path = prepare_inputs([long, fresh, decode, cached], BLOCK, torch.device("cpu"))
    assert (torch_path.meta.num_kernel_rows, torch_path.meta.prefill_chunks) == (0, None)
    assert [p.q_start for p in torch_path.meta.prefills] == [1, 17, 37]


@pytest.mark.parametrize("head_dim", [64, 72])  # 72: the prefill kernel refuses it: all rows
def test_paged_attention_on_the_kernels_matches_its_torch_path(wide_lib, head_dim):
    from workers.device.layers.attention import PagedAttention
    from workers.device.model_runner import SeqState, prepare_inputs
    from workers.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, num_blocks = 4, 2, 32
    caches = [torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen) for _ in "kv"]

    def state(name: str, computed: int, scheduled: int, first_block: int) -> SeqState:
        length = computed + scheduled
        blocks = list(range(first_block, first_block + -(-length // BLOCK)))
        s = SeqState(name, length, list(range(length)), SamplingParams(), blocks)
        s.num_computed_tokens, s.num_scheduled = computed, scheduled
        return s

    # A decode, a short fresh chunk (rows), a long one and one over a prefix (prefill kernel).
    states = [
        state("d", 40, 1, 0),
        state("s", 0, 20, 3),
        state("l", 0, 90, 5),
        state("p", 70, 9, 12),
    ]
    total = sum(s.num_scheduled for s in states)
    q = torch.randn(total, heads, head_dim, generator=gen)
    k = torch.randn(total, kv_heads, head_dim, generator=gen)
    v = torch.randn(total, kv_heads, head_dim, generator=gen)
    attention = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    outs, metas = {}, {}
    for path, kernel_lib in (("kernels", wide_lib), ("torch", None)):
        inp = prepare_inputs(states, BLOCK, torch.device("cpu"), kernel_lib)
        # Both layouts put the tokens in the same order here: decodes, then the chunks.
        assert inp.positions.tolist() == [40, *range(20), *range(90), *range(70, 79)]
        cache = tuple(c.clone() for c in caches)
        outs[path], metas[path] = attention(q, k, v, cache, inp.meta), inp.meta
    assert metas["kernels"].num_row_kernel_rows == 21
    assert metas["kernels"].prefill_chunks.tolist() == [[21, 90, 0], [111, 9, 70]]
    torch.testing.assert_close(outs["kernels"], outs["torch"], atol=2e-5, rtol=1e-4)
