"""Tiny random compressed-tensors FP8 checkpoints (llm-compressor's "float-quantized" format,
as RedHatAI's FP8-dynamic checkpoints ship) and int8 W8A16 ones ("int-quantized") for tests.

`make_ct_checkpoint(strategy, path)` writes the dense Qwen3 of tests/fp8_checkpoints.py with
every attention and MLP projection stored float8_e4m3fn and a float32 `<name>.weight_scale`:
per output channel ([out, 1]), per tensor ([1]) or per 128x128 block; the embeddings, norms
and LM head in float32 (`ignore: ["lm_head"]`). Input activations are declared FP8 with dynamic
per-token scales (W8A8) unless `activations=False` (weight-only).

`make_int8_checkpoint(strategy, path)` writes the same model with every projection stored
int8 and a float32 `<name>.weight_scale` per output channel ([out, 1]) or per group of
`group_size` input columns ([out, in / group_size]), no input activations (W8A16): the layout
and config the compressed-tensors package itself writes for its "W8A16" preset saved as
"int-quantized" (checked by hand against its ModelCompressor's output).

The packing is hand-written here (FP8: scale = amax / 448 over the channel, tensor or block,
weight / scale rounded to e4m3; int8: scale = amax / 127 over the channel or group, weight /
scale rounded to the nearest integer), not taken from llm-compressor or kvray. `load_hf_ct` is the
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
INT8_STRATEGIES = ("channel", "group")
INT8_GROUP = 128  # the W8A16 preset's group size
_FP8_MAX = 448.0
_INT8_MAX = 127.0


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


def quantize_int8(w: Any, strategy: str, group: int = INT8_GROUP) -> tuple[Any, Any]:
    """(int8 weight, float32 scale [rows, groups]) of `w` [rows, cols]: per output channel
    (one group of every column) or per `group` columns of a row, symmetric."""
    import torch

    rows, cols = w.shape
    g = w.float().reshape(rows, -1, group if strategy == "group" else cols)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    q = torch.round(g / scale).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8).reshape(rows, cols)
    return q, scale.squeeze(-1).contiguous()


def int8_quantization_config(strategy: str, group: int = INT8_GROUP) -> dict[str, Any]:
    """What the compressed-tensors package saves for its W8A16 scheme, format int-quantized."""
    weights = {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": False,
        "group_size": group if strategy == "group" else None,
    }  # fmt: skip
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {**scheme, "output_activations": None, "format": "int-quantized"}
        },
        "ignore": ["lm_head"],
    }


def make_int8_checkpoint(strategy: str, path: Path, group: int = INT8_GROUP) -> Path:
    return write_packed_checkpoint(
        path,
        lambda w: _weight_and_scale(quantize_int8(w, strategy, group)),
        int8_quantization_config(strategy, group),
    )


def make_ct_checkpoint(strategy: str, path: Path, activations: bool = True) -> Path:
    return write_packed_checkpoint(
        path,
        lambda w: _weight_and_scale(quantize(w, strategy)),
        quantization_config(strategy, activations),
    )


def _weight_and_scale(packed: tuple[Any, Any]) -> dict[str, Any]:
    return {"weight": packed[0], "weight_scale": packed[1]}


def write_packed_checkpoint(path: Path, pack: Any, qcfg: dict[str, Any]) -> Path:
    """The dense test Qwen3 at `path`, each projection's weight replaced by the tensors `pack`
    returns for it (names relative to the projection), `qcfg` its quantization_config."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    base = make_fp8_checkpoint("qwen3", path.with_name(path.name + "-base"), quantize=False)
    shutil.copytree(base, path, dirs_exist_ok=True)
    (weights,) = path.glob("*.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(weights)).items():
        if _quantized(name):
            prefix = name.removesuffix("weight")
            out.update({prefix + k: v for k, v in pack(t).items()})
        else:
            out[name] = t
    save_file(out, str(weights), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qcfg
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_hf_ct(path: Path) -> Any:
    """transformers' loading of the checkpoint, its weights decompressed (float32 math)."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
