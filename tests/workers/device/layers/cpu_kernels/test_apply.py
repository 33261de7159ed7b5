"""`use_cpu_kernels` (a loaded model's layers onto the kernels) and the engine on them: which
modules take the library, the packed copies, narrower builds, and the tokens."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.workers.device.layers.cpu_kernels.helpers import BLOCK, Width, state, toy_model
from tests.workers.kernel_builds import avx2_build
from workers.device.layers.cpu_kernels import register, use_cpu_kernels, wide_vectors


def test_a_cpu_float32_engine_routes_through_the_kernels(lib, demo_llm):
    worker = demo_llm.engine.executor.worker
    assert worker.cpu_kernel is lib
    model = worker.model
    layer = model.layers[-1]
    attn = layer.self_attn
    assert all(m.cpu_kernels == register(lib) for m in (layer.mlp, attn.q_norm, attn.rotary))
    # The linears only where the GEMM kernels are fast (64-byte vectors).
    linears = (model.lm_head, attn.qkv_proj, layer.mlp.down_proj)
    assert all(m.cpu_kernels == (register(lib) if wide_vectors(lib) else None) for m in linears)


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
        llm = LLM(
            str(demo_dir),
            kv_cache_memory_bytes=16 << 20,
            max_num_batched_tokens=64,
            cpu_kernels=use_kernel,
        )
        assert (llm.engine.executor.worker.cpu_kernel is not None) == use_kernel
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the prefix
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.stats().prefix_cache_hits > 0
        llm.engine.shutdown()
    assert outs[0] == outs[1]


def test_use_cpu_kernels_frees_only_unshared_bfloat16_weights(wide_lib):

    model = toy_model(bf16=True)
    proj_w, head_w = model.proj.weight.clone(), model.head.weight.clone()
    x = torch.randn(300, 32)  # above BF16_MAX_ROWS: the packed copy, the weight being freed
    expected = F.linear(x, proj_w, model.proj.bias)

    added = use_cpu_kernels(model, wide_lib)

    assert model.proj.packed_weight is not None and model.head.packed_weight is not None
    assert model.proj.weight.is_meta
    assert not model.head.weight.is_meta  # the embedding still reads it
    assert torch.equal(model.embed.weight, head_w)
    packed = model.proj.packed_weight.nbytes + model.head.packed_weight.nbytes
    assert added == packed - proj_w.nbytes
    torch.testing.assert_close(model.proj(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.head(x[:5]), F.linear(x[:5], head_w), atol=1e-5, rtol=1e-5)


def test_use_cpu_kernels_leaves_float32_valued_weights_alone(wide_lib):

    model = toy_model(bf16=False)
    assert use_cpu_kernels(model, wide_lib) == 0
    assert model.proj.packed_weight is None and not model.proj.weight.is_meta
    assert model.proj.cpu_kernels == register(
        wide_lib
    )  # the skinny kernel and the BLAS still serve it


@pytest.mark.parametrize("vector_bytes", [16, 32])
def test_narrower_builds_route_to_the_kernels_they_have_tiles_for(lib, vector_bytes):
    """AVX2 (32 bytes): bfloat16 weights take their GEMM, float32 ones keep torch's linear (no
    skinny GEMM), prefill chunks the prefill kernel. Narrower: torch's linear and SDPA."""
    from workers.device.model_runner import prepare_inputs

    narrow = Width(lib, vector_bytes)
    tiled = vector_bytes == 32
    model = toy_model(bf16=True)
    assert (use_cpu_kernels(model, narrow) != 0) == tiled
    for module in (model.proj, model.head):
        assert module.cpu_kernels == (register(narrow) if tiled else None)
        assert (module.packed_weight is not None) == tiled
    assert model.proj.weight.is_meta == tiled and not model.head.weight.is_meta
    f32 = toy_model(bf16=False)
    assert use_cpu_kernels(f32, narrow) == 0
    assert f32.proj.cpu_kernels is None and f32.proj.packed_weight is None

    seqs = [
        state("long", 136, 120, 16, list(range(10, 19))),
        state("decode", 31, 30, 1, [1, 2]),
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
    keep torch) and on a build reporting 16-byte vectors (kernels off: torch's paths),
    against this host's build: a mixed workload with prefix hits and chunked prefill."""
    from workers import LLM, SamplingParams
    from workers.device.layers.cpu_kernels import build as build_mod
    from workers.device.models.cpu_layers import CpuLayers

    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(10, 3000, (80,), generator=gen).tolist()
    prompts = [prefix + torch.randint(10, 3000, (n,), generator=gen).tolist() for n in (5, 40)]
    prompts.append(torch.randint(10, 3000, (150,), generator=gen).tolist())
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    other = avx2_build() if build == "avx2" else Width(lib, 16)
    outs = []
    for this in (lib, other):
        monkeypatch.setattr(build_mod, "kernel", lambda this=this: this)
        llm = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64)
        worker = llm.engine.executor.worker
        model = worker.model
        if this is other and build == "narrow":
            assert str(worker.forward.strategy.kernels) == "off: vectors narrower than 32 bytes"
            assert worker.cpu_kernel is None and worker.forward.direct is None
        else:
            # Decode steps still run as direct calls, with torch's linear off AVX-512.
            assert isinstance(worker.forward.direct, CpuLayers)
            wide = wide_vectors(this)
            handle = register(this) if wide else None
            assert model.layers[0].mlp.down_proj.cpu_kernels == handle
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the prefix
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.stats().prefix_cache_hits > 0
        llm.engine.shutdown()
    assert outs[0] == outs[1]
