"""The kernels as torch custom ops: their fake implementations and declared mutations
(`torch.library.opcheck`), torch.compile tracing through them, and a compiled engine with the
kernels on giving the eager engine's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from workers.device.layers.cpu_kernels import pack_bf16_weight, register


def _opcheck(op, args) -> None:  # noqa: ANN001
    # The schema, the fake implementation (shapes, dtypes) and the declared mutations.
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_the_elementwise_ops_pass_opcheck(lib):
    h = register(lib)
    x, w = torch.randn(5, 64), torch.rand(64) + 0.5
    _opcheck(torch.ops.kvray.rms_norm.default, (x, w, 1e-6, h))
    _opcheck(torch.ops.kvray.rms_norm.default, (torch.randn(3, 4, 64), w, 1e-6, h))
    _opcheck(torch.ops.kvray.silu_and_mul.default, (torch.randn(3, 2 * 48), h))
    cos, sin = torch.randn(32, 64), torch.randn(32, 64)
    q, k, pos = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.tensor([0, 5, 31])
    _opcheck(torch.ops.kvray.rotary_.default, (q, k, pos, cos, sin, h))


def test_the_linear_ops_pass_opcheck(lib):
    h = register(lib)
    x = torch.randn(6, 64)
    w = torch.randn(48, 64).bfloat16().float()
    packed, bias = pack_bf16_weight(w), torch.randn(48)
    for rows in (1, 8, 300):  # bfloat16 kernel, skinny, the BLAS
        xr = torch.randn(rows, 64)
        _opcheck(torch.ops.kvray.linear.default, (xr, w, packed, bias, 48, h))
        _opcheck(torch.ops.kvray.linear.default, (xr, torch.randn(48, 64), None, None, 48, h))
    _opcheck(torch.ops.kvray.linear.default, (x, None, packed, None, 48, h))  # freed float32
    out = torch.empty(6, 48)
    _opcheck(torch.ops.kvray.bf16_linear_out.default, (x, packed, bias, out, h))
    _opcheck(torch.ops.kvray.skinny_linear_out.default, (x, w, None, out, h))


def test_the_attention_ops_pass_opcheck(lib):
    h = register(lib)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(8, 16, 2, 64, generator=gen) for _ in "kv")
    q = torch.randn(5, 4, 64, generator=gen)
    tables = torch.randint(0, 8, (5, 3), generator=gen)
    lens = torch.tensor([1, 16, 17, 30, 48])
    op = torch.ops.kvray.paged_decode_attention.default
    _opcheck(op, (q, k_cache, v_cache, tables, lens, 0.125, h))
    chunks = torch.tensor([[0, 5, 0]])
    out = torch.empty_like(q)
    op = torch.ops.kvray.paged_prefill_attention.default
    _opcheck(op, (q, k_cache, v_cache, tables, chunks, out, 0.125, h))


def test_torch_compile_traces_through_the_ops(lib):
    """No graph break (fullgraph), the kvray ops in the graph, and the eager results."""
    from workers.config import RopeConfig
    from workers.device.layers.norm import RMSNorm
    from workers.device.layers.rotary import RotaryEmbedding

    norm = RMSNorm(64, 1e-6, torch.float32)
    rope = RotaryEmbedding(RopeConfig(), 64, 128, torch.float32)
    norm.cpu_kernels = rope.cpu_kernels = register(lib)
    ops: set[str] = set()

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def piece(positions, q, k):  # noqa: ANN001, ANN202
        return rope(positions, norm(q), norm(k))

    compiled = torch.compile(piece, backend=backend, fullgraph=True)
    positions, q, k = torch.tensor([3, 7, 100]), torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    got = compiled(positions, q.clone(), k.clone())
    expected = piece(positions, q.clone(), k.clone())
    assert any("kvray.rms_norm" in op for op in ops), ops
    assert any("kvray.rotary_" in op for op in ops), ops
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_compiled_engine_with_the_kernels_gives_the_eager_tokens(dtype, tmp_path):
    """Every step compiled (compile_min_tokens=1), the kernels on as custom ops inside the
    pieces: the eager engine's tokens. A bfloat16 checkpoint: one copy of each weight."""
    from tests.checkpoints import make_checkpoint
    from workers import LLM, SamplingParams

    path = make_checkpoint("qwen3", tmp_path / "qwen3", dtype=dtype)
    kwargs = dict(kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64)
    eager = LLM(str(path), **kwargs)
    compiled = LLM(str(path), compile=True, compile_min_tokens=1, **kwargs)
    worker = compiled.engine.executor.worker
    if worker.cpu_kernel is None:
        pytest.skip("CPU kernels off here")
    assert worker.forward.compiled is not None and worker.forward.strategy.compiled
    qkv = worker.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.is_meta == (dtype == "bfloat16")  # no float32 copy kept for compiling
    rng = random.Random(2)
    vocab = eager.engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 17, 40, 100)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    assert got == want
