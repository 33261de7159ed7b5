"""Small C kernels for CPU (sources in workers/device/layers/csrc/), built on first use with
the system C compiler into one library and called as torch custom ops (`torch.ops.kvray.*`),
which torch.compile traces through:
- paged decode attention: the torch-native decode path gathers every sequence's K/V into a
  padded tensor (a copy as large as the context, per layer, per step) before attending; on
  CPU that copy costs more than the attention itself. The kernel reads K/V in place from
  the block pool.
- paged prefill attention: the query tokens of prefill chunks, in blocks that share each
  K/V read, flash-attention style;
- skinny GEMM: linear layers of steps with a few rows (workers/device/layers/linear.py);
- bfloat16-weight GEMM: linear layers whose weights are exactly bfloat16 (a bfloat16
  checkpoint served in float32): half the bytes per step and in memory, the same values;
  on CPUs with AMX (Xeons since Sapphire Rapids) on its tiles instead, with x cut into three
  bfloat16 pieces so that the result keeps float32 accuracy (csrc/amx_linear.c);
- RMSNorm in one pass instead of seven torch ops (workers/device/layers/norm.py);
- rotary embedding of q and k in place, one pass (workers/device/layers/rotary.py);
- SiLU-and-mul of the fused gate/up projection (workers/device/models/llama.py MLP).

Modules: build (compile, cache, load, probe: `kernel()`, `build.build(march)`,
`KernelState`), calls (the ctypes calls), ops (the custom ops and the functions the layers
call), packing (bfloat16 weight layouts), routing (which GEMM serves a step), apply
(`use_cpu_kernels`: a loaded model's layers onto the kernels). If no compiler is available
the engine keeps the torch paths (same results up to float rounding).
"""

from workers.device.layers.cpu_kernels.apply import on_amx_tiles, use_cpu_kernels
from workers.device.layers.cpu_kernels.build import (
    KernelState,
    amx,
    kernel,
    kernel_state,
    library_name,
    tiled_kernels,
    wide_vectors,
)
from workers.device.layers.cpu_kernels.calls import check_gemm
from workers.device.layers.cpu_kernels.ops import (
    bf16_linear,
    kernel_linear,
    library,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    register,
    rms_norm_cpu,
    rotary_cpu,
    silu_and_mul_cpu,
    skinny_linear,
)
from workers.device.layers.cpu_kernels.packing import (
    AMX_CHUNK,
    BF16_PANEL,
    amx_packed,
    pack_bf16_weight,
)
from workers.device.layers.cpu_kernels.routing import BF16_MAX_ROWS, SKINNY_ROWS, kernel_route

__all__ = [
    "AMX_CHUNK",
    "BF16_MAX_ROWS",
    "BF16_PANEL",
    "SKINNY_ROWS",
    "KernelState",
    "amx",
    "amx_packed",
    "bf16_linear",
    "check_gemm",
    "kernel",
    "kernel_linear",
    "kernel_route",
    "kernel_state",
    "library",
    "library_name",
    "on_amx_tiles",
    "paged_decode_attention_cpu",
    "paged_prefill_attention_cpu",
    "pack_bf16_weight",
    "register",
    "rms_norm_cpu",
    "rotary_cpu",
    "silu_and_mul_cpu",
    "skinny_linear",
    "tiled_kernels",
    "use_cpu_kernels",
    "wide_vectors",
]
