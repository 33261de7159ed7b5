"""`python -m cluster.bench.step.w8a16`: decode tokens/s of a random-weight model in full
precision against the same model as an int8 weight-only (W8A16, compressed-tensors
int-quantized, per-channel scales) checkpoint, in one run, through `kvray bench step`'s
decode measurement (cluster/bench/step/main.py `measure`).

Three engines, one after the other, the same prompts and settings: the full-precision
checkpoint; the int8 one with its fast path (CPU's int8 GEMM, `torch._weight_int8pack_mm`,
where workers/device/layers/int8_linear.py takes it: bfloat16, steps of at most 16 rows; the
dequantizing reference elsewhere); the int8 one dequantized in every forward (`cpu_kernels`
off). The
int8 checkpoint is written once beside the random model (`<dir>-w8a16`), each projection
quantized per output channel (scale = amax / 127).

    OMP_NUM_THREADS=1 python -m cluster.bench.step.w8a16 --model random:qwen3-100m \\
        --dtype bfloat16 --batch-sizes 1,32
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cluster.bench.step.quantized import quantized_checkpoint, run_decode_comparison

if TYPE_CHECKING:
    import torch


def _int8_per_channel(t: torch.Tensor) -> dict[str, torch.Tensor]:
    import torch

    w = t.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale.contiguous()}


def int8_checkpoint(src: Path) -> Path:
    """`src` with every decoder projection stored int8 + a float32 per-channel weight_scale."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    return quantized_checkpoint(src, "w8a16", _int8_per_channel, config)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m cluster.bench.step.w8a16"
    return run_decode_comparison(prog, __doc__, "int8", int8_checkpoint, argv)


if __name__ == "__main__":
    raise SystemExit(main())
