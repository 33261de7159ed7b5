"""Tiny random FP8 block-scaled checkpoints (Qwen3-*-FP8 / DeepSeek-V3 layout) for tests.

`make_fp8_checkpoint(kind, path)` writes a complete HF model directory of a dense Qwen3 or a
Qwen3-MoE model whose dimensions are multiples of 128 (transformers infers the block from the
scale grid, so other dimensions would make the reference silently wrong), with:

- every attention and MLP projection, experts included, stored as `float8_e4m3fn` with a
  float32 `<name>.weight_scale_inv` of shape [out / 128, in / 128];
- embeddings, norms, the MoE router and the LM head in float32 (the router and the LM head
  named in `modules_to_not_convert`, as Qwen3-30B-A3B-FP8 does);
- config.json's `quantization_config`: quant_method "fp8", weight_block_size [128, 128],
  activation_scheme "dynamic" (`quantization` overrides or adds keys; None values drop them).

The packing is hand-written here (`quantize_blocks`: per 128x128 block, scale = amax / 448,
weight / scale rounded to e4m3), not taken from transformers or kvray, so neither side's
quantizer is the one under test. `load_hf_fp8` is the reference: transformers' own loading of
the checkpoint, dequantizing at load (`FineGrainedFP8Config(dequantize=True)`), in float32.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.checkpoints import _SPECS as DENSE_SPECS
from tests.checkpoints import _config, _copy_tokenizer, _weights, _write_weights, write_config
from tests.moe_checkpoints import _SPECS as MOE_SPECS
from tests.moe_checkpoints import _experts

FP8_KINDS = ("qwen3", "qwen3_moe")
BLOCK = 128
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn

# head_dim 128 (one block per head), hidden 256, MLP 512: every dimension a multiple of 128.
_SHAPES = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 128, "num_layers": 2}
_SPECS = {
    "qwen3": replace(DENSE_SPECS["qwen3"], intermediate_size=512, **_SHAPES),
    "qwen3_moe": replace(MOE_SPECS["qwen3_moe"], intermediate_size=512, **_SHAPES),
}
# The weights drawn as tests.checkpoints draws them, then scaled to that module's std over
# hidden 128 times sqrt(128 / 256): logits as far from uniform as its checkpoints'.
_STD_SCALE = 0.5**0.5


def quantize_blocks(w: Any) -> tuple[Any, Any]:
    """(float8_e4m3fn weight, float32 scale_inv [rows / 128, cols / 128]) of `w` [rows, cols]:
    each 128x128 block divided by its amax / 448, so w ~= fp8 * scale_inv blockwise."""
    import torch

    rows, cols = w.shape
    blocks = w.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX)
    return q.to(torch.float8_e4m3fn).reshape(rows, cols), scale_inv.float().contiguous()


def _quantized(name: str) -> bool:
    """Attention and MLP projections (experts too); not the embeddings, norms, router, head."""
    return name.endswith("_proj.weight") and ".layers." in name


def make_fp8_checkpoint(
    kind: str,
    path: Path,
    *,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int = 256,
    intermediate_size: int = 512,
    quantization: dict[str, Any] | None = None,
    quantize: bool = True,
    seed: int = 0,
) -> Path:
    """Write a tiny random FP8 checkpoint of `kind` (one of FP8_KINDS) into `path`. Qwen3-MoE:
    layer 0 dense (mlp_only_layers), layer 1 sparse; `num_experts`, `top_k` and the experts'
    `moe_intermediate_size` are its MoE settings. quantize=False: the same model before
    quantization (float32, no quantization_config), to compare bytes with."""
    import torch

    if kind not in _SPECS:
        raise ValueError(f"kind must be one of {FP8_KINDS}, got {kind!r}")
    spec = replace(_SPECS[kind], intermediate_size=intermediate_size)
    from workers.demo import demo_model_dir

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size, special_ids = _copy_tokenizer(demo_model_dir(), path)
    config = {**_config(spec, "new", vocab_size, special_ids), "torch_dtype": "float32"}
    seed = seed * 1000003 + zlib.crc32(f"fp8-{kind}".encode())
    tensors = _weights(spec, vocab_size, seed=seed)
    skip = ["lm_head"]
    if kind == "qwen3_moe":
        config.update(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
            moe_intermediate_size=moe_intermediate_size,
        )
        names = ("gate_proj", "up_proj", "down_proj")
        tensors.update(
            _experts(spec.hidden_size, moe_intermediate_size, num_experts, [1], names, "mlp", seed)
        )
        for proj in names:  # layer 1's dense MLP: not in a sparse layer's checkpoint
            del tensors[f"model.layers.1.mlp.{proj}.weight"]
        skip.append("model.layers.1.mlp.gate")
    write_config(path, config, as_written=False)
    qcfg = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": skip,
        **(quantization or {}),
    }
    if quantize:
        saved = json.loads((path / "config.json").read_text())
        saved["quantization_config"] = {k: v for k, v in qcfg.items() if v is not None}
        (path / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t * _STD_SCALE if t.dim() == 2 and not name.endswith("embed_tokens.weight") else t
        if quantize and _quantized(name):
            q, s = quantize_blocks(t)
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q, s
        else:
            out[name] = t.contiguous()
    _write_weights(out, path, sharded=False)
    return path


def load_hf_fp8(path: Path) -> Any:
    """transformers' own loading of the FP8 checkpoint: its FineGrainedFP8 quantizer
    dequantizes each weight with its scale grid at load (float32 math), model in float32."""
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    qcfg = FineGrainedFP8Config(weight_block_size=[BLOCK, BLOCK], dequantize=True)
    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=qcfg
    ).eval()
