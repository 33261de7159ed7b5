"""The Triton paged-attention and KV-store kernels, on CPU under Triton's interpreter, against
dense torch attention over each sequence's gathered context (float32, small shapes)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from tests.triton_interpret import interpreted_kernels
from workers.device.layers import kv_quant
from workers.device.layers.triton_metadata import block_q_for, program_table


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    yield from interpreted_kernels()


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: list[list[int]],
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    window: int,
) -> torch.Tensor:
    """Per sequence: gather its context through its block table, then dense attention with
    a causal (and window) mask, query heads grouped over KV heads."""
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    row = 0
    for table, qn, total in zip(tables, query_lens, seq_lens, strict=True):
        pos = torch.arange(total)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        k = k_cache.flatten(0, 1)[slots].repeat_interleave(group, 1).transpose(0, 1)
        v = v_cache.flatten(0, 1)[slots].repeat_interleave(group, 1).transpose(0, 1)
        qp = torch.arange(total - qn, total)
        mask = pos[None, :] <= qp[:, None]
        if window:
            mask &= pos[None, :] > qp[:, None] - window
        qs = q[row : row + qn].transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[row : row + qn] = o.transpose(0, 1)
        row += qn
    return out


def _run(
    mod: ModuleType,
    query_lens: list[int],
    seq_lens: list[int],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    window: int = 0,
    tile: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    kv_scales: tuple[float, float] | None = None,  # an FP8 cache with these scales
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # Each sequence's blocks scattered over the pool (not contiguous, not in order).
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in blocks_per_seq:
        tables.append(perm[i : i + n])
        i += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g)
    v_cache = torch.randn(shape, generator=g)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    # Rounded to `dtype` for the kernel; the reference computes in float32 from those values.
    q, k_cache, v_cache = (t.to(dtype).float() for t in (q, k_cache, v_cache))
    k_in, v_in, scales = k_cache.to(dtype), v_cache.to(dtype), (1.0, 1.0)
    if kv_scales is not None:  # the kernel reads FP8; the reference the values they stand for
        scales = kv_scales
        k_in, v_in = kv_quant.quantize(k_cache, scales[0]), kv_quant.quantize(v_cache, scales[1])
        k_cache = kv_quant.dequantize(k_in, scales[0], torch.float32)
        v_cache = kv_quant.dequantize(v_in, scales[1], torch.float32)

    max_blocks = max(blocks_per_seq)
    bt = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = torch.tensor(t)
    qlens = np.asarray(query_lens, dtype=np.int32)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32))
    block_q = block_q_for(heads, kv_heads)
    seq, qoff = program_table(qlens, block_q)
    got = mod.paged_attention(
        q.to(dtype),
        k_in,
        v_in,
        bt,
        torch.tensor(seq_lens, dtype=torch.int32),
        cu,
        torch.from_numpy(seq),
        torch.from_numpy(qoff),
        block_q,
        scale,
        window=window,
        tile=tile,
        scales=scales,
    )
    want = _reference(q, k_cache, v_cache, tables, query_lens, seq_lens, scale, window)
    return got, want


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_half_precision_products_sum_in_float32(kernels: ModuleType) -> None:
    """A 16-bit cache takes the other branch of the kernel (products in the cache's dtype,
    the probabilities rounded to it, sums in float32), as bfloat16 models do on a GPU; the
    interpreter has no bfloat16 arithmetic, so float16 stands in for it here."""
    got, want = _run(kernels, [1, 1, 20, 9], [33, 17, 20, 40], dtype=torch.float16)
    assert got.dtype == torch.float16
    # The probabilities and the output rounded to 11 bits: 7e-4 off the float32 reference
    # here, where a wrong position or mask is off by ~1e-1.
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # GQA ratios 1, 2, 4 over 4 query heads
@pytest.mark.parametrize("block_size", [16, 8])
def test_mixed_batch_matches_dense_attention(
    kernels: ModuleType, kv_heads: int, block_size: int
) -> None:
    """Decodes, a fresh prompt, a chunk over a cached prefix and a one-token prompt in one
    launch; contexts cross block boundaries."""
    query_lens = [1, 1, 21, 7, 1]
    seq_lens = [17, 40, 21, 33, 1]
    got, want = _run(
        kernels,
        query_lens,
        seq_lens,
        kv_heads=kv_heads,
        block_size=block_size,
    )
    _check(got, want)


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 48: padded to 64 inside the kernel
def test_head_dims(kernels: ModuleType, head_dim: int) -> None:
    got, want = _run(kernels, [1, 9], [30, 20], heads=2, kv_heads=1, head_dim=head_dim)
    _check(got, want)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(kernels: ModuleType, window: int) -> None:
    got, want = _run(kernels, [1, 12, 3], [50, 12, 40], window=window)
    _check(got, want)


def test_tile_spanning_several_blocks(kernels: ModuleType) -> None:
    """A K/V tile of 32 tokens over blocks of 8: each token's block is looked up."""
    got, want = _run(kernels, [1, 10], [70, 45], block_size=8, tile=32)
    _check(got, want)


def test_wrong_answer_is_caught(kernels: ModuleType) -> None:
    """The comparison can fail: a different scale gives different outputs."""
    got, want = _run(kernels, [1, 4], [9, 4])
    assert not torch.allclose(got * 1.01, want, atol=2e-5, rtol=2e-5)


def test_store_kv_matches_index_copy(kernels: ModuleType) -> None:
    g = torch.Generator().manual_seed(1)
    nb, bs, kh, d = 6, 8, 2, 16
    k_cache = torch.randn(nb, bs, kh, d, generator=g)
    v_cache = torch.randn(nb, bs, kh, d, generator=g)
    slots = torch.tensor([5, 17, 40, 3, 47], dtype=torch.int64)
    # Non-contiguous K/V, as q/k/v split out of one projection are.
    qkv = torch.randn(len(slots), 3, kh, d, generator=g)
    k, v = qkv[:, 1], qkv[:, 2]
    want_k = k_cache.clone().view(nb * bs, kh, d).index_copy_(0, slots, k)
    want_v = v_cache.clone().view(nb * bs, kh, d).index_copy_(0, slots, v)
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(nb * bs, kh, d), want_k)
    assert torch.equal(v_cache.view(nb * bs, kh, d), want_v)


def test_program_table(kernels: ModuleType) -> None:
    seq, qoff = program_table(np.array([1, 9, 4]), 4)
    assert seq.tolist() == [0, 1, 1, 1, 2]
    assert qoff.tolist() == [0, 0, 4, 8, 0]


def test_an_fp8_cache_is_read_times_its_scales(kernels: ModuleType) -> None:
    """The FP8 cache's elements times the layer's K and V scales: the values the reference
    attends over (workers/device/layers/kv_quant.py)."""
    got, want = _run(kernels, [1, 1, 20, 9], [33, 17, 20, 40], kv_scales=(0.25, 2.0))
    _check(got, want)


def test_store_kv_into_an_fp8_cache_is_kv_quants_store(kernels: ModuleType) -> None:
    """Scaled, clamped to e4m3's range (a value of 1000 is 448 there, not NaN) and rounded as
    torch rounds (7.99 to 8.0): the bytes of the torch path's store."""
    g = torch.Generator().manual_seed(2)
    nb, bs, kh, d = 6, 8, 2, 16
    slots = torch.tensor([5, 17, 40, 3, 47], dtype=torch.int64)
    k = torch.randn(len(slots), kh, d, generator=g) * 3
    v = torch.randn(len(slots), kh, d, generator=g)
    k[0, 0, 0] = 1000.0
    caches = [torch.zeros(nb, bs, kh, d, dtype=kv_quant.FP8) for _ in range(4)]
    kernels.store_kv(k, v, caches[0], caches[1], slots, (0.5, 0.125))
    kv_quant.store(caches[2].view(nb * bs, kh, d), slots, k, 0.5)
    kv_quant.store(caches[3].view(nb * bs, kh, d), slots, v, 0.125)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[0].view(nb * bs, kh, d)[5, 0, 0].float() == 448.0
