"""`kvray bench kernels`: the CPU kernels (workers/device/layers/cpu_kernels/) against the torch
ops they replace, per step size, side by side in one process.

For each row count (the tokens of a decode step: one per sequence) it times, with random
tensors of the model's shapes (no weights are loaded):
- linear: every layer's projections and the LM head, torch's matmul (the BLAS) against the
  skinny kernel and against the bfloat16-weight kernel (the weights are drawn on the
  bfloat16 grid, as a bfloat16 checkpoint's are), and on CPUs with AMX against the AMX
  kernel the engine then uses for those weights; each layer gets its own weights, so they
  stream from memory as in a step;
- decode attention: the torch-native path (gather of the paged K/V, SDPA with a length
  mask) against the C kernel, contexts uniform around --context;
- small ops: every layer's RMSNorms, rotary and SiLU-and-mul, torch against the kernels.
It prints ms per forward's worth of each and the ratio torch / kernel (above 1: the kernel is
faster). The engine uses the skinny kernel for `SKINNY_ROWS` with float32 weights, the bfloat16
one up to `BF16_MAX_ROWS` rows with exactly-bfloat16 weights
(workers/device/layers/cpu_kernels/routing.py).

Then, per prefill chunk length (--chunk-lens, over a cached prefix of --prefix tokens), every
layer's attention of one chunk three ways: torch's SDPA (the torch-native path), the decode
kernel a row per query token, and the prefill kernel; the engine picks between the last two
by context (`workers.device.model_runner.PREFILL_KERNEL_MIN_CONTEXT`).

Kept free of torch at import: this module is reachable from `kvray --help`.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.bench.common.roofline import ModelShape

BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--model",
        default=None,
        help="model whose shapes to use: HF checkpoint directory (default: the built-in demo "
        "model) or random:qwen3-100m / random:qwen3-0.6b (shapes only, nothing is written)",
    )
    a(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16, 24, 32, 64, 128],
        help="step sizes (tokens = decode sequences) to time (default: 1 4 8 16 24 32 64 128)",
    )
    a("--context", type=int, default=128, help="mean context of a decode sequence (default 128)")
    a(
        "--chunk-lens",
        type=int,
        nargs="+",
        default=[16, 64, 128, 512, 2048],
        help="prefill chunk lengths to time (default: 16 64 128 512 2048)",
    )
    a("--prefix", type=int, default=0, help="cached tokens before each chunk (default 0)")
    a("--repeats", type=int, default=7, help="timed repeats per figure; the best is kept")
    a("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch

    from workers.device.layers.cpu_kernels import (
        amx,
        kernel,
        pack_bf16_weight,
        tiled_kernels,
        wide_vectors,
    )

    if any(r < 1 for r in args.rows) or args.context < 1 or args.repeats < 1:
        raise SystemExit("--rows, --context and --repeats must be positive")
    if any(n < 1 for n in args.chunk_lens) or args.prefix < 0:
        raise SystemExit("--chunk-lens must be positive and --prefix at least 0")
    lib = kernel()
    if lib is None:
        print("the CPU kernels are unavailable here (no C compiler?): nothing to compare")
        return 1
    shape = _shape(args.model)
    torch.manual_seed(args.seed)
    print(
        f"kvray bench kernels: {shape.layers} layers, hidden {shape.hidden}, heads "
        f"{shape.heads}/{shape.kv_heads} x {shape.head_dim}, intermediate {shape.intermediate}, "
        f"vocab {shape.vocab}; float32 on cpu, {torch.get_num_threads()} torch threads; "
        f"ms per forward (best of {args.repeats}), torch / kernel"
    )
    if not tiled_kernels(lib):
        print(
            "note: this build has vectors narrower than AVX2: the engine keeps torch's linear "
            "and SDPA for prefill chunks instead of the GEMM and prefill kernels timed below"
        )
    elif not wide_vectors(lib):
        print(
            "note: this build has no 64-byte vectors (AVX-512): the engine keeps torch's linear "
            "for float32 weights instead of the skinny GEMM timed below"
        )
    on_amx = amx(lib)  # bfloat16 weights run on the AMX tiles then (csrc/amx_linear.c)
    header = (
        f"{'rows':>5}  {'linear (skinny)':>22}  {'linear (bf16 weights)':>22}  "
        + (f"{'linear (bf16, AMX)':>22}  " if on_amx else "")
        + f"{'decode attention':>22}  {'norms+rotary+silu':>22}"
    )
    print(header)
    print("-" * len(header))
    weights = _weights(shape)
    layouts = [[pack_bf16_weight(w) for w in weights]]
    if on_amx:
        layouts.append([pack_bf16_weight(w, amx=True) for w in weights])
    for rows in args.rows:
        blas, skinny, *packed = _linear(lib, weights, layouts, rows, args.repeats)
        cells = [
            (blas, skinny),
            *((blas, ms) for ms in packed),
            _attention(lib, shape, rows, args.context, args.repeats),
            _small_ops(lib, shape, rows, args.repeats),
        ]
        print(f"{rows:>5}  " + "  ".join(_cell(*c) for c in cells))
    print()
    print(
        f"prefill attention of one chunk over {args.prefix} cached tokens, ms per forward: "
        "SDPA, then each kernel and SDPA / kernel"
    )
    header = f"{'chunk':>5}  {'SDPA':>7}  {'rows (decode kernel)':>21}  {'prefill kernel':>21}"
    print(header)
    print("-" * len(header))
    for n in args.chunk_lens:
        sdpa, rows_ms, blocks = _prefill(lib, shape, n, args.prefix, args.repeats)
        print(
            f"{n:>5}  {sdpa:7.2f}  {rows_ms:12.2f} {sdpa / rows_ms:7.2f}x  "
            f"{blocks:12.2f} {sdpa / blocks:7.2f}x"
        )
    return 0


def _shape(model: str | None) -> ModelShape:
    if model and model.startswith("random:"):
        from cluster.bench.common.random_model import PRESETS

        name = model.split(":", 1)[1]
        if name not in PRESETS:
            raise SystemExit(f"unknown random model {name!r}; presets: {', '.join(PRESETS)}")
        return ModelShape(*PRESETS[name])  # both in ModelShape's field order
    if model:
        try:
            return ModelShape.from_dir(Path(model))
        except (OSError, ValueError, KeyError) as e:
            msg = f"--model {model}: not a checkpoint with a readable config.json ({e})"
            raise SystemExit(msg) from None
    from workers.demo import demo_model_dir

    return ModelShape.from_dir(demo_model_dir())


def _weights(s: Any) -> list[Any]:
    import torch

    per_layer = [
        ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),  # qkv
        (s.hidden, s.heads * s.head_dim),  # o
        (2 * s.intermediate, s.hidden),  # gate/up
        (s.hidden, s.intermediate),  # down
    ]
    shapes = [*(shape for _ in range(s.layers) for shape in per_layer), (s.vocab, s.hidden)]
    # On the bfloat16 grid (held in float32), as the engine holds a bfloat16 checkpoint's.
    return [(torch.randn(n, k) * 0.02).bfloat16().float() for n, k in shapes]


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm: first-call allocations and thread start-up are not the op's cost
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _linear(
    lib: Any, weights: list[Any], layouts: list[list[Any]], rows: int, repeats: int
) -> list[float]:
    """ms for all the layers' linears: torch, the skinny kernel, then the bfloat16-weight
    kernel of each packed layout (bf16_linear.c's, and amx_linear.c's where it runs). Each
    writes into outputs allocated once, as the engine's step does (workers/device/models/
    cpu_layers.py): a fresh output per call had added page faults that grow with the rows."""
    import torch

    from workers.device.layers.cpu_kernels import bf16_linear, skinny_linear

    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    outs = [torch.empty(rows, w.shape[0]) for w in weights]
    with torch.inference_mode():

        def torch_linears() -> None:  # what the engine's step runs for float32 weights
            for w, o in zip(weights, outs, strict=True):
                torch.mm(xs[w.shape[1]], w.t(), out=o)

        def skinny_linears() -> None:
            for w, o in zip(weights, outs, strict=True):
                skinny_linear(lib, xs[w.shape[1]], w, None, o)

        def packed_linears(packed: list[Any]) -> None:
            for w, p, o in zip(weights, packed, outs, strict=True):
                bf16_linear(lib, xs[w.shape[1]], p, w.shape[0], None, o)

        t = _best(torch_linears, repeats)
        k = _best(skinny_linears, repeats)

        packed_ms = [_best(functools.partial(packed_linears, p), repeats) for p in layouts]
    return [t, k, *packed_ms]


def _kv_caches(s: Any, num_blocks: int) -> list[tuple[Any, Any]]:
    """A random paged K and V pool per layer, as the engine allocates them."""
    import torch

    shape = (num_blocks, BLOCK_SIZE, s.kv_heads, s.head_dim)
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(s.layers)]


def _attention(lib: Any, s: Any, rows: int, context: int, repeats: int) -> tuple[float, ...]:
    import torch
    from torch.nn import functional as F

    from workers.device.layers.cpu_kernels import paged_decode_attention_cpu

    lens = torch.randint(max(1, context // 2), context + context // 2 + 1, (rows,))
    max_blocks = -(-int(lens.max()) // BLOCK_SIZE)
    num_blocks = rows * max_blocks
    caches = _kv_caches(s, num_blocks)
    tables = torch.randperm(num_blocks).view(rows, max_blocks)  # scattered, as in a pool
    q = torch.randn(rows, s.heads, s.head_dim)
    mask = (torch.arange(max_blocks * BLOCK_SIZE)[None, :] < lens[:, None])[:, None, None, :]
    scale = s.head_dim**-0.5

    def torch_path() -> None:  # workers/device/layers/attention.py's decode branch without a kernel
        for kc, vc in caches:
            kd = kc[tables].flatten(1, 2).transpose(1, 2)
            vd = vc[tables].flatten(1, 2).transpose(1, 2)
            F.scaled_dot_product_attention(
                q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True
            )

    def kernel_path() -> None:
        for kc, vc in caches:
            paged_decode_attention_cpu(lib, q, kc, vc, tables, lens, scale)

    with torch.inference_mode():
        return _best(torch_path, repeats), _best(kernel_path, repeats)


def _prefill(lib: Any, s: Any, n: int, prefix: int, repeats: int) -> tuple[float, ...]:
    import torch
    from torch.nn import functional as F

    from workers.device.layers.cpu_kernels import (
        paged_decode_attention_cpu,
        paged_prefill_attention_cpu,
    )

    ctx = prefix + n
    num_blocks = -(-ctx // BLOCK_SIZE)
    caches = _kv_caches(s, num_blocks)
    table = torch.randperm(num_blocks)  # scattered, as in a pool
    tables = table.expand(n, num_blocks).contiguous()  # a row per query token
    lens = torch.arange(prefix + 1, ctx + 1)
    chunks = torch.tensor([[0, n, prefix]])
    positions = torch.arange(ctx)
    slots = table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    mask = positions[None, :] <= lens[:, None] - 1 if prefix else None
    q = torch.randn(n, s.heads, s.head_dim)
    out = torch.empty_like(q)
    scale = s.head_dim**-0.5

    def sdpa() -> None:  # workers/device/layers/attention.py's prefill branch without a kernel
        for kc, vc in caches:
            k = kc.flatten(0, 1)[slots].transpose(0, 1)
            v = vc.flatten(0, 1)[slots].transpose(0, 1)
            F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k[None],
                v[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )

    def rows() -> None:
        for kc, vc in caches:
            paged_decode_attention_cpu(lib, q, kc, vc, tables, lens, scale)

    def blocks() -> None:
        for kc, vc in caches:
            paged_prefill_attention_cpu(lib, q, kc, vc, tables, chunks, out, scale)

    with torch.inference_mode():
        return _best(sdpa, repeats), _best(rows, repeats), _best(blocks, repeats)


def _small_ops(lib: Any, s: Any, rows: int, repeats: int) -> tuple[float, ...]:
    import torch

    from workers.config import RopeConfig
    from workers.device.layers.cpu_kernels import register, silu_and_mul_cpu
    from workers.device.layers.norm import RMSNorm
    from workers.device.layers.rotary import RotaryEmbedding

    norm = RMSNorm(s.hidden, 1e-6, torch.float32)
    head_norm = RMSNorm(s.head_dim, 1e-6, torch.float32)
    rope = RotaryEmbedding(RopeConfig(), s.head_dim, 4096, torch.float32)
    x = torch.randn(rows, s.hidden)
    qkv = torch.randn(rows, (s.heads + 2 * s.kv_heads) * s.head_dim)
    gate_up = torch.randn(rows, 2 * s.intermediate)
    positions = torch.randint(0, 4096, (rows,))
    q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def layer_ops(use_kernels: bool) -> None:  # one layer's worth, as llama.py runs them
        for module in (norm, head_norm, rope):
            module.cpu_kernels = register(lib) if use_kernels else None
        for _ in range(s.layers):
            norm(x)
            q = head_norm(qkv[:, :q_size].view(rows, s.heads, s.head_dim))
            k = head_norm(qkv[:, q_size : q_size + kv_size].view(rows, s.kv_heads, s.head_dim))
            rope(positions, q, k)
            norm(x)
            if use_kernels:
                silu_and_mul_cpu(lib, gate_up)
            else:
                gate, up = gate_up.split(s.intermediate, dim=-1)
                torch.nn.functional.silu(gate) * up

    with torch.inference_mode():
        return _best(lambda: layer_ops(False), repeats), _best(lambda: layer_ops(True), repeats)


def _cell(torch_ms: float, kernel_ms: float) -> str:
    return f"{torch_ms:7.2f} / {kernel_ms:6.2f} {torch_ms / kernel_ms:4.2f}x"
