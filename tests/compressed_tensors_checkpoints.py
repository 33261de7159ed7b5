"""Tiny random compressed-tensors FP8 checkpoints (llm-compressor's "float-quantized" format,
as RedHatAI's FP8-dynamic checkpoints ship) for tests.

`make_ct_checkpoint(strategy, path)` writes the dense Qwen3 of tests/fp8_checkpoints.py with
every attention and MLP projection stored float8_e4m3fn and a float32 `<name>.weight_scale`:
per output channel ([out, 1]), per tensor ([1]) or per 128x128 block; the embeddings, norms
and LM head in float32 (`ignore: ["lm_head"]`). Input activations are declared FP8 with dynamic
per-token scales (W8A8) unless `activations=False` (weight-only).

The packing is hand-written here (scale = amax / 448 over the channel, tensor or block,
weight / scale rounded to e4m3), not taken from llm-compressor or kvray. `load_hf_ct` is the
reference: transformers' own loading through the compressed-tensors package, decompressing
the weights at load (`CompressedTensorsConfig(dequantize=True)`), in float32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.fp8_checkpoints import BLOCK, _quantized, make_fp8_checkpoint, quantize_blocks

STRATEGIES = ("channel", "tensor", "block")
_FP8_MAX = 448.0


def quantize(w: Any, strategy: str) -> tuple[Any, Any]:
    """(float8_e4m3fn weight, float32 scale) of `w` [rows, cols] under `strategy`."""
    import torch

    if strategy == "block":
        return quantize_blocks(w)
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()[None]
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    q = (w / (scale if strategy == "channel" else scale[0])).clamp(-_FP8_MAX, _FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale.float().contiguous()


def quantization_config(strategy: str, activations: bool = True) -> dict[str, Any]:
    weights: dict[str, Any] = {
        "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
    }  # fmt: skip
    if strategy == "block":
        weights["block_structure"] = [BLOCK, BLOCK]
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts if activations else None,
            }
        },
        "ignore": ["lm_head"],
    }


def make_ct_checkpoint(strategy: str, path: Path, activations: bool = True) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    base = make_fp8_checkpoint("qwen3", path.with_name(path.name + "-base"), quantize=False)
    shutil.copytree(base, path, dirs_exist_ok=True)
    (weights,) = path.glob("*.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(weights)).items():
        if _quantized(name):
            out[name], out[name.removesuffix("weight") + "weight_scale"] = quantize(t, strategy)
        else:
            out[name] = t
    save_file(out, str(weights), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config(strategy, activations)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_hf_ct(path: Path) -> Any:
    """transformers' loading of the checkpoint, its weights decompressed (float32 math)."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
