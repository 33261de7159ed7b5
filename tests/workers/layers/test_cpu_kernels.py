"""The C decode-attention kernel against torch's SDPA over the same gathered K/V."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from workers.layers.cpu_kernels import kernel, paged_decode_attention_cpu, skinny_linear

BLOCK = 16


@pytest.fixture(scope="module")
def lib():
    lib = kernel()
    if lib is None:
        pytest.skip("no C compiler: the engine uses the torch path")
    return lib


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
        (17, 6, 2, 32),  # no specialised shape: the generic loop
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


def test_loading_the_kernel_keeps_denormals(lib):
    # Linking a library with -ffast-math would switch the whole process to flush-to-zero.
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 0.5).item() > 0.0


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 24])
@pytest.mark.parametrize(("in_features", "out_features"), [(256, 768), (100, 37), (768, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_torch(lib, rows, in_features, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None

    out = skinny_linear(lib, x, w, b)

    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_skinny_linear_takes_a_row_slice(lib):
    # The LM head receives rows picked out of the step's hidden states: any layout works.
    x = torch.randn(12, 64)[::2]
    w = torch.randn(48, 64)
    torch.testing.assert_close(skinny_linear(lib, x, w, None), F.linear(x, w, None))


def test_a_cpu_float32_engine_routes_through_the_kernels(lib, demo_llm):
    worker = demo_llm.engine.executor.worker
    assert worker.cpu_kernel is lib
    model = worker.model
    routed = [model.lm_head, model.layers[0].self_attn.qkv_proj, model.layers[-1].mlp.down_proj]
    assert all(m.cpu_kernels is lib for m in routed)
