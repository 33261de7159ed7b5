"""Tiny random compressed-tensors int4 W4A16 checkpoints (llm-compressor's "pack-quantized"
format, as RedHatAI's *-quantized.w4a16 checkpoints ship) for tests, quantized and packed by
the compressed-tensors package itself, not by kvray.

`make_w4a16_checkpoint(strategy, path, symmetric=True, group=128)` writes the dense test
Qwen3 of tests/fp8_checkpoints.py (hidden 256, q 512, MLP 512) with every attention and MLP
projection compressed as the package's ModelCompressor compresses a Linear: scale and zero
point from its `calculate_qparams` over each output channel or group of `group` input
columns (min / max of the weights), then its `PackedQuantizationCompressor.compress`
(quantize, `pack_to_int32`; zero points packed along the rows when asymmetric). The config is
its own QuantizationConfig's `to_dict()` for the W4A16 (or W4A16_ASYM) scheme, format
pack-quantized. The embeddings, norms and LM head stay float32 (`ignore: ["lm_head"]`).
`load_hf_ct` (tests/compressed_tensors_checkpoints.py) is the reference loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.compressed_tensors_checkpoints import write_packed_checkpoint

W4A16_STRATEGIES = ("group", "channel", "group-asym")
W4A16_GROUP = 128  # the W4A16 preset's group size


def w4a16_scheme(strategy: str, symmetric: bool = True, group: int = W4A16_GROUP) -> Any:
    """The compressed-tensors QuantizationScheme: 4-bit int weights per group or channel."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=symmetric,
        strategy=strategy,
        group_size=group if strategy == "group" else None,
        dynamic=False,
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def compress(w: Any, scheme: Any) -> dict[str, Any]:
    """`w` [out, in] compressed by the package: weight_packed, weight_scale, weight_shape (and
    weight_zero_point when asymmetric)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    rows, cols = w.shape
    per = args.group_size if args.strategy == "group" else cols
    g = w.float().reshape(rows, cols // per, per)
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
    state = {"weight": w.float(), "weight_scale": scale.float()}
    if not args.symmetric:
        state["weight_zero_point"] = zero.to(torch.int8)
    out = PackedQuantizationCompressor.compress(state, scheme)
    return {k: v.contiguous() for k, v in out.items()}


def w4a16_quantization_config(scheme: Any) -> dict[str, Any]:
    """The package's own quantization_config for `scheme`, format pack-quantized."""
    from compressed_tensors.quantization import QuantizationConfig as CTConfig

    ct = CTConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"])
    ct.quantization_status = "compressed"  # what ModelCompressor writes beside the weights
    return json.loads(json.dumps(ct.to_dict(), default=str))


def make_w4a16_checkpoint(strategy: str, path: Path, group: int = W4A16_GROUP) -> Path:
    """`strategy`: "group", "channel", or "group-asym" (asymmetric, zero points)."""
    base_strategy, _, asym = strategy.partition("-")
    scheme = w4a16_scheme(base_strategy, symmetric=not asym, group=group)
    return write_packed_checkpoint(
        path, lambda t: compress(t, scheme), w4a16_quantization_config(scheme)
    )
