"""Routes a loaded model's layers through the kernels: `use_cpu_kernels`."""

from __future__ import annotations

import ctypes

import torch

from workers.device.layers.cpu_kernels.build import amx, tiled_kernels, wide_vectors
from workers.device.layers.cpu_kernels.ops import register
from workers.device.layers.cpu_kernels.packing import amx_packed, pack_bf16_weight


def use_cpu_kernels(model: torch.nn.Module, lib: ctypes.CDLL) -> int:
    """Route a loaded model's layers through `lib`: every module with a `cpu_kernels` slot
    (linear layers and the LM head, norms, rotary, MLP) whose tensors are dense float32 gets
    the library's handle (`ops.register`), which its forward passes to the `kvray::` ops.

    Linear layers whose weights are exactly bfloat16 also get a packed bfloat16 copy
    (`packed_weight`), in the AMX tiles' layout where this process may use them (`amx`).
    A weight no other module shares (a tied LM head shares the embedding's) is then replaced
    by a shape-only meta tensor and every step of the layer, eager or compiled, reads the
    copy: half the float32 weight's memory instead of half as much again.
    Linear layers take the library where one of its GEMMs is fast: with a packed copy where
    it has the bfloat16 GEMM's tiles (`tiled_kernels`), without one only on AVX-512 builds
    (`wide_vectors`, the skinny GEMM); others keep torch's linear and their float32 weights.
    Returns the bytes of host memory this adds (negative: frees)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    added = 0
    handle = register(lib)
    tiled, wide = tiled_kernels(lib), wide_vectors(lib)
    on_amx = tiled and amx(lib)  # asks for the tile state in this process: the one that runs
    for module in model.modules():
        if not hasattr(module, "cpu_kernels"):
            continue
        tensors = [*module.parameters(), *module.buffers()]
        if not tensors or not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
            continue
        if not hasattr(module, "packed_weight"):  # norms, rotary, MLP activation
            module.cpu_kernels = handle
            continue
        weight = module.weight
        packed = pack_bf16_weight(weight, amx=on_amx) if tiled else None
        if packed is None:
            if wide:
                module.cpu_kernels = handle
            continue
        module.cpu_kernels, module.packed_weight = handle, packed
        added += packed.nbytes
        if holders[id(weight)] == 1:
            module.weight = torch.nn.Parameter(
                torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False
            )
            added -= weight.nbytes
    return added


def on_amx_tiles(model: torch.nn.Module) -> bool:
    """Whether `use_cpu_kernels` packed some of `model`'s weights for the AMX tiles."""
    packed = (getattr(m, "packed_weight", None) for m in model.modules())
    return any(p is not None and amx_packed(p) for p in packed)
