"""The C kernels against the torch ops they replace: decode and prefill attention against
SDPA over the same gathered K/V, the skinny and bfloat16-weight GEMMs, norms, rotary,
SiLU-and-mul, and the batch layout that routes rows to them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.workers.kernel_builds import avx2_build, cpu_flags
from workers.config import RopeConfig
from workers.device.layers.cpu_kernels import (
    bf16_linear,
    kernel,
    pack_bf16_weight,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    silu_and_mul_cpu,
    skinny_linear,
    tiled_kernels,
    wide_vectors,
)
from workers.device.layers.norm import RMSNorm
from workers.device.layers.rotary import RotaryEmbedding

BLOCK = 16


@pytest.fixture(scope="module")
def lib():
    lib = kernel()
    if lib is None:
        pytest.skip("no C compiler: the engine uses the torch path")
    return lib


class _Width:
    """The real library, reporting vectors of `bytes` (32: an AVX2 build, 64: AVX-512)."""

    def __init__(self, lib, bytes: int) -> None:  # noqa: A002
        self._lib, self._bytes = lib, bytes

    def kvray_vector_bytes(self) -> int:
        return self._bytes

    def __getattr__(self, name: str):
        return getattr(self._lib, name)


@pytest.fixture(scope="module", params=["native", "avx2"])
def tiled_lib(request, lib):
    """`lib`, then the same kernels built for AVX2 (-march=haswell): the bfloat16 GEMM's and
    the prefill kernel's register tiles for 32-byte vectors run on any AVX2 host."""
    return lib if request.param == "native" else avx2_build()


@pytest.fixture(scope="module")
def wide_lib(lib):
    """`lib`, reporting 64-byte vectors whatever it was built for: the routing to the GEMM and
    prefill kernels is tested on any host (without AVX-512 they are slow there, not wrong)."""
    return lib if wide_vectors(lib) else _Width(lib, 64)


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


def test_the_cached_library_is_per_cpu_and_compiler():
    from workers.device.layers.cpu_kernels import library_name

    name = library_name(b"src", ["-O3"], "x86_64 flags: avx2 gcc 12")
    assert name.startswith("kvray-cpu-kernels-") and name.endswith(".so")
    assert name == library_name(b"src", ["-O3"], "x86_64 flags: avx2 gcc 12")
    others = [
        library_name(b"src", ["-O3"], "x86_64 flags: avx2 avx512f gcc 12"),  # another CPU
        library_name(b"src", ["-O3"], "x86_64 flags: avx2 gcc 13"),  # another compiler
        library_name(b"src2", ["-O3"], "x86_64 flags: avx2 gcc 12"),
        library_name(b"src", ["-O2"], "x86_64 flags: avx2 gcc 12"),
    ]
    assert name not in others and len(set(others)) == len(others)


def test_loading_the_kernel_keeps_denormals(lib):
    # Linking a library with -ffast-math would switch the whole process to flush-to-zero.
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 0.5).item() > 0.0


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 24, 40])
@pytest.mark.parametrize(
    ("in_features", "out_features"),
    [(256, 768), (100, 37), (768, 4), (600, 9)],  # 600: a tail after the vector loop
)
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
    layer = model.layers[-1]
    attn = layer.self_attn
    assert all(m.cpu_kernels is lib for m in (layer.mlp, attn.q_norm, attn.rotary))
    # The linears only where the GEMM kernels are fast (64-byte vectors).
    linears = (model.lm_head, attn.qkv_proj, layer.mlp.down_proj)
    assert all(m.cpu_kernels is (lib if wide_vectors(lib) else None) for m in linears)


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 256: the threaded branch
def test_rms_norm_matches_the_torch_path(lib, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(256, 1e-6, torch.float32)
    norm.weight.copy_(torch.randn(256, generator=gen))
    x = torch.randn(rows, 256, generator=gen) * 4
    expected = norm(x)
    norm.cpu_kernels = lib
    torch.testing.assert_close(norm(x), expected, atol=1e-5, rtol=1e-5)


def test_rms_norm_of_heads_viewed_out_of_a_fused_projection(lib):
    # q = qkv[:, :q_size].view(T, H, Dh): rows of Dh are dense, heads and tokens strided.
    qkv = torch.randn(6, 4 * 64 + 2 * 2 * 64)
    q = qkv[:, : 4 * 64].view(6, 4, 64)
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.copy_(torch.rand(64) + 0.5)
    expected = norm(q)
    norm.cpu_kernels = lib
    out = norm(q)
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 256: the threaded branch
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(lib, rows):
    # The residual step of CpuLayers.run: x += delta in place, then the norm of the new x.
    gen = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, 256, generator=gen) * 4, torch.randn(rows, 256, generator=gen)
    weight = torch.randn(256, generator=gen)
    expected_x = x + delta
    expected = torch.empty(rows, 256)
    lib.rms_norm(
        expected_x.data_ptr(), weight.data_ptr(), expected.data_ptr(), rows, 1, 256, 256, 256, 1e-6
    )
    out = torch.full((rows, 256), float("nan"))
    lib.add_rms_norm(
        x.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, 256, 1e-6
    )
    assert torch.equal(x, expected_x)
    assert torch.equal(out, expected)
    norm = RMSNorm(256, 1e-6, torch.float32)
    norm.weight.copy_(weight)
    torch.testing.assert_close(out, norm(expected_x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_rotary_matches_the_torch_path(lib, fused):
    rope = RotaryEmbedding(RopeConfig(), 64, 512, torch.float32)
    positions = torch.tensor([0, 1, 7, 300, 511, 42], dtype=torch.int64)
    if fused:  # llama without q/k norms: q and k are views into the qkv projection
        qkv = torch.randn(6, 4 * 64 + 2 * 2 * 64)
        q, k = qkv[:, :256].view(6, 4, 64), qkv[:, 256:384].view(6, 2, 64)
    else:
        q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    eq, ek = rope(positions, q, k)
    rope.cpu_kernels = lib
    oq, ok = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(oq, eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, ek, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 9, 200])  # 200 x 768: the threaded branch
def test_silu_and_mul_matches_torch(lib, rows):
    gate_up = torch.randn(rows, 2 * 384) * 4
    gate, up = gate_up.split(384, dim=-1)
    torch.testing.assert_close(
        silu_and_mul_cpu(lib, gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("shape", [(256,), (2, 3, 256), (2, 3, 4, 256)])
def test_rms_norm_of_other_ranks(lib, shape):
    norm = RMSNorm(256, 1e-6, torch.float32)
    x = torch.randn(*shape)
    expected = norm(x)
    norm.cpu_kernels = lib
    out = norm(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rotary_takes_int32_positions(lib):
    rope = RotaryEmbedding(RopeConfig(), 64, 512, torch.float32)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    positions = torch.tensor([5, 400, 9])
    eq, ek = rope(positions, q, k)
    rope.cpu_kernels = lib
    oq, ok = rope(positions.to(torch.int32), q.clone(), k.clone())
    torch.testing.assert_close(oq, eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, ek, atol=1e-5, rtol=1e-5)


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


def test_the_kernel_path_gives_the_torch_paths_tokens(demo_dir):
    from workers import LLM, SamplingParams

    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(10, 3000, (80,), generator=gen).tolist()
    # Suffixes over the cached prefix and a chunked prompt: the prefill kernel; a short
    # prompt (context under 64): a row per token.
    prompts = [prefix + torch.randint(10, 3000, (n,), generator=gen).tolist() for n in (5, 40)]
    prompts.append(torch.randint(10, 3000, (150,), generator=gen).tolist())  # chunked
    prompts.append(torch.randint(10, 3000, (30,), generator=gen).tolist())  # short
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for use_kernel in (True, False):
        # 64-token steps: fresh chunks, the long prompt's later chunks and the prefix hits --
        # the CPU kernels on one side, SDPA (with a gathered context over a prefix) on the
        # other.
        llm = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64)
        if not use_kernel:
            llm.engine.executor.worker.cpu_kernel = None
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the prefix
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.stats().prefix_cache_hits > 0
        llm.engine.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("rows", [1, 3, 8, 12, 13, 30, 96, 200])  # 200: two blocks of x
@pytest.mark.parametrize(
    ("in_features", "out_features"),
    [(256, 768), (100, 37), (768, 4), (64, 32), (48, 70)],  # partial panels, one panel
)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_torch_on_the_same_values(
    tiled_lib, rows, in_features, out_features, bias
):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    w = w.float()  # exactly bfloat16 values, held in float32 as the engine holds them
    b = torch.randn(out_features, generator=gen) if bias else None
    packed = pack_bf16_weight(w)
    assert packed is not None

    out = bf16_linear(tiled_lib, x, packed, out_features, b)

    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_bf16_packing_refuses_weights_that_are_not_bfloat16():
    w = torch.randn(40, 16).bfloat16().float()
    assert pack_bf16_weight(w) is not None
    w[3, 5] += 2**-20  # one value off the bfloat16 grid would change the layer
    assert pack_bf16_weight(w) is None


def test_bf16_linear_takes_a_row_slice(lib):
    x = torch.randn(12, 64)[::2]
    w = torch.randn(48, 64).bfloat16().float()
    out = bf16_linear(lib, x, pack_bf16_weight(w), 48, None)
    torch.testing.assert_close(out, F.linear(x, w, None))


def test_the_linear_kernels_write_into_a_given_output(lib):
    # The benchmarks time them into outputs allocated once, as the engine's step runs them.
    x, w = torch.randn(6, 64), torch.randn(48, 64).bfloat16().float()
    for linear in (
        lambda out: bf16_linear(lib, x, pack_bf16_weight(w), 48, None, out),
        lambda out: skinny_linear(lib, x, w, None, out),
    ):
        out = torch.full((6, 48), float("nan"))
        assert linear(out) is out
        torch.testing.assert_close(out, F.linear(x, w, None))
        for wrong in (torch.empty(6, 47), torch.empty(48, 6).t(), torch.empty(6, 48).double()):
            with pytest.raises(ValueError, match="out must be"):
                linear(wrong)


def test_linear_routes_rows_by_count_and_weight(lib, monkeypatch):
    from workers.device.layers import linear as linear_mod

    w32 = torch.randn(64, 32)
    w16 = w32.bfloat16().float()
    packed = pack_bf16_weight(w16)
    calls: list[str] = []
    for name, real in (("bf16_linear", bf16_linear), ("skinny_linear", skinny_linear)):
        # Records which kernel ran, then runs it (the result is still checked below).
        def spy(*args, _name=name, _real=real):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(linear_mod, name, spy)
    for rows, w, p, expected in [
        (1, w16, packed, "bf16_linear"),
        (linear_mod.BF16_MAX_ROWS, w16, packed, "bf16_linear"),
        (linear_mod.BF16_MAX_ROWS + 1, w16, packed, None),  # the BLAS
        (1000, torch.empty(64, 32, device="meta"), packed, "bf16_linear"),  # freed float32
        (8, w32, None, "skinny_linear"),  # float32 weights: the skinny kernel
        (1, w32, None, None),
    ]:
        calls.clear()
        x = torch.randn(rows, 32)
        out = linear_mod.linear(x, w, None, lib, p)
        assert calls == ([expected] if expected else []), (rows, expected)
        torch.testing.assert_close(out, F.linear(x, w16 if w.is_meta else w), atol=1e-5, rtol=1e-5)


def _toy_model(bf16: bool) -> torch.nn.Module:
    """A column-parallel linear, and an LM head tied to an embedding (they share a weight)."""
    from workers.device.distributed import TPGroup
    from workers.device.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from workers.device.layers.linear import ColumnParallelLinear

    tp, f32 = TPGroup(), torch.float32
    model = torch.nn.Module()
    model.proj = ColumnParallelLinear(32, [48, 16], True, tp, f32)
    model.embed = VocabParallelEmbedding(100, 32, tp, f32)
    model.head = ParallelLMHead(model.embed, 100, 32, tp, f32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape).bfloat16().float() if bf16 else torch.randn(p.shape))
    return model


@pytest.mark.parametrize("free", [False, True])
def test_use_cpu_kernels_frees_only_unshared_bfloat16_weights(wide_lib, free):
    from workers.device.layers.cpu_kernels import use_cpu_kernels

    model = _toy_model(bf16=True)
    proj_w, head_w = model.proj.weight.clone(), model.head.weight.clone()
    x = torch.randn(300, 32)  # above BF16_MAX_ROWS: the BLAS unless the weight was freed
    expected = F.linear(x, proj_w, model.proj.bias)

    added = use_cpu_kernels(model, wide_lib, free_float32=free)

    assert model.proj.packed_weight is not None and model.head.packed_weight is not None
    assert model.proj.weight.is_meta == free
    assert not model.head.weight.is_meta  # the embedding still reads it
    assert torch.equal(model.embed.weight, head_w)
    packed = model.proj.packed_weight.nbytes + model.head.packed_weight.nbytes
    assert added == packed - (proj_w.nbytes if free else 0)
    torch.testing.assert_close(model.proj(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.head(x[:5]), F.linear(x[:5], head_w), atol=1e-5, rtol=1e-5)


def test_use_cpu_kernels_leaves_float32_valued_weights_alone(wide_lib):
    from workers.device.layers.cpu_kernels import use_cpu_kernels

    model = _toy_model(bf16=False)
    assert use_cpu_kernels(model, wide_lib, free_float32=True) == 0
    assert model.proj.packed_weight is None and not model.proj.weight.is_meta
    assert model.proj.cpu_kernels is wide_lib  # the skinny kernel and the BLAS still serve it


def test_the_library_reports_the_vectors_it_was_built_for(lib):
    flags = cpu_flags()
    assert wide_vectors(lib) == ("avx512f" in flags)  # the build is -march=native
    assert tiled_kernels(lib) == ("avx2" in flags)
    assert tiled_kernels(_Width(lib, 32)) and not wide_vectors(_Width(lib, 32))
    assert not tiled_kernels(_Width(lib, 16))


def _state(name: str, length: int, computed: int, scheduled: int, blocks: list[int]):
    from workers.device.model_runner import SeqState
    from workers.sampling_params import SamplingParams

    s = SeqState(name, length, list(range(length)), SamplingParams(), blocks)
    s.num_computed_tokens, s.num_scheduled = computed, scheduled
    return s


@pytest.mark.parametrize("vector_bytes", [16, 32])
def test_narrower_builds_route_to_the_kernels_they_have_tiles_for(lib, vector_bytes):
    """AVX2 (32 bytes): bfloat16 weights take their GEMM, float32 ones keep torch's linear (no
    skinny GEMM), prefill chunks the prefill kernel. Narrower: torch's linear and SDPA."""
    from workers.device.layers.cpu_kernels import use_cpu_kernels
    from workers.device.model_runner import prepare_inputs

    narrow = _Width(lib, vector_bytes)
    tiled = vector_bytes == 32
    model = _toy_model(bf16=True)
    assert (use_cpu_kernels(model, narrow, free_float32=True) != 0) == tiled
    for module in (model.proj, model.head):
        assert module.cpu_kernels is (narrow if tiled else None)
        assert (module.packed_weight is not None) == tiled
    assert model.proj.weight.is_meta == tiled and not model.head.weight.is_meta
    f32 = _toy_model(bf16=False)
    assert use_cpu_kernels(f32, narrow, free_float32=True) == 0
    assert f32.proj.cpu_kernels is None and f32.proj.packed_weight is None

    seqs = [
        _state("long", 136, 120, 16, list(range(10, 19))),
        _state("decode", 31, 30, 1, [1, 2]),
    ]
    meta = prepare_inputs(seqs, BLOCK, torch.device("cpu"), narrow).meta
    if tiled:  # the chunk after the decode, in the prefill kernel
        assert (meta.num_decodes, meta.num_kernel_rows, meta.prefills) == (1, 17, [])
        assert meta.prefill_chunks.tolist() == [[1, 16, 120]]
    else:
        assert (meta.num_decodes, meta.num_kernel_rows, meta.prefill_chunks) == (1, 1, None)
        assert [(p.q_start, p.q_len, p.context_len) for p in meta.prefills] == [(1, 16, 136)]


@pytest.mark.parametrize("build", ["avx2", "narrow"])
def test_narrower_builds_give_the_same_tokens(demo_dir, lib, build, monkeypatch):
    """The engine on the AVX2 build (its prefill kernel's tiles; the demo's float32 linears
    keep torch) and on a build reporting 16-byte vectors, against this host's build: a mixed
    workload with prefix hits and chunked prefill."""
    import workers.device.layers.cpu_kernels as cpu_kernels
    from workers import LLM, SamplingParams
    from workers.device.models.cpu_layers import CpuLayers

    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(10, 3000, (80,), generator=gen).tolist()
    prompts = [prefix + torch.randint(10, 3000, (n,), generator=gen).tolist() for n in (5, 40)]
    prompts.append(torch.randint(10, 3000, (150,), generator=gen).tolist())
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    other = avx2_build() if build == "avx2" else _Width(lib, 16)
    outs = []
    for this in (lib, other):
        monkeypatch.setattr(cpu_kernels, "kernel", lambda this=this: this)
        llm = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64)
        model = llm.engine.executor.worker.model
        # Decode steps still run as direct calls, with torch's linear off AVX-512.
        assert isinstance(model.cpu_layers, CpuLayers)
        wide = wide_vectors(this)
        assert model.layers[0].mlp.down_proj.cpu_kernels is (this if wide else None)
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the prefix
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.stats().prefix_cache_hits > 0
        llm.engine.shutdown()
    assert outs[0] == outs[1]
