"""`python -m cluster.bench.step.w4a16`: decode tokens/s of a random-weight model in full
precision against the same model as an int4 weight-only (W4A16, compressed-tensors
pack-quantized, symmetric, a scale per group of 128 input columns: llm-compressor's W4A16
preset) checkpoint, in one run, through `kvray bench step`'s decode measurement
(cluster/bench/step/main.py `measure`).

Three engines, one after the other, the same prompts and settings: the full-precision
checkpoint; the int4 one with its fast path (CPU's 4-bit GEMM, `torch._weight_int4pack_mm_for_cpu`,
where workers/device/layers/int4_linear.py takes it: bfloat16, steps of at most 32 rows; the
dequantizing reference elsewhere); the int4 one dequantized in every forward (`cpu_kernels`
off). The int4 checkpoint is written once beside the random model (`<dir>-w4a16`).

    OMP_NUM_THREADS=1 python -m cluster.bench.step.w4a16 --model random:qwen3-100m \\
        --batch-sizes 1,32
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cluster.bench.step.quantized import quantized_checkpoint, run_decode_comparison

if TYPE_CHECKING:
    import torch

GROUP = 128


def _int4_per_group(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """scale = amax / 7.5 per group (the compressed-tensors package's symmetric 4-bit range,
    -8..7), packed eight to an int32."""
    import torch

    from workers.device.layers.int4_linear import pack_int4

    rows, cols = t.shape
    g = t.float().reshape(rows, cols // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax))
    q = torch.round(g / scale).clamp(-8, 7).reshape(rows, cols) + 8
    return {
        "weight_packed": pack_int4(q.to(torch.uint8)),
        "weight_scale": scale.squeeze(-1).contiguous(),
        "weight_shape": torch.tensor([rows, cols]),
    }


def int4_checkpoint(src: Path) -> Path:
    """`src` with every decoder projection packed int4, a scale per group of 128 columns."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {**weights, "group_size": GROUP}}
        },
        "ignore": ["lm_head"],
    }
    return quantized_checkpoint(src, "w4a16", _int4_per_group, config)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m cluster.bench.step.w4a16"
    return run_decode_comparison(prog, __doc__, "int4", int4_checkpoint, argv)


if __name__ == "__main__":
    raise SystemExit(main())
