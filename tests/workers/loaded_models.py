"""A model built and loaded as a rank does (no engine), and its projections' weights in float32
whatever they are stored as: what the loader tests compare with the checkpoint's tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.config import ModelConfig
from workers.device.distributed import TPGroup
from workers.device.layers.fp8_linear import dequantize
from workers.device.layers.int8_linear import dequantize_int8
from workers.device.loader import load_weights
from workers.device.models import build_model


def loaded_model(path: Path, tp: TPGroup) -> torch.nn.Module:
    c = ModelConfig.from_pretrained(path)
    model = build_model(c, tp, torch.float32, 64)
    load_weights(model, c, tp)
    return model


def float_weight(module: torch.nn.Module) -> torch.Tensor:
    """int4: the layer's own float32 reference weights; int8 and FP8 dequantized by their
    scales; full precision as held."""
    if hasattr(module, "weight_packed"):
        return module.dequantized(torch.float32)
    if module.weight.dtype == torch.int8:
        return dequantize_int8(module.weight, module.weight_scale, torch.float32)
    if hasattr(module, "weight_scale_inv"):
        return dequantize(module.weight, module.weight_scale_inv, module.scale_rows, torch.float32)
    return module.weight.data
