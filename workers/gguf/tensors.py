"""A GGUF file's tensors under the Hugging Face names the loader knows
(workers/device/loader.py), converted into what kvray holds.

- Names: `token_embd` -> `model.embed_tokens`, `blk.N.attn_q` -> `model.layers.N.self_attn.
  q_proj`, and so on (llama.cpp's standard tensor names).
- Llama's Q and K: llama.cpp's converter reorders each head's rows for its RoPE kernel (the two
  rotated halves interleaved, row pairs (i, i + head_dim / 2) made adjacent); they are put back
  in Hugging Face's order, as transformers' GGUF loader does, by head count (the KV heads' for
  K). Qwen2 and Qwen3 files are stored in Hugging Face's order.
- Values: a Q8_0 projection of a model whose quantization is int8 (workers/gguf/config.py)
  becomes int8 plus `weight_scale` [rows, cols / 32]; a Q4_0 / Q4_K one of an int4 model the
  int4 layer's `weight_packed`, `weight_scale`, `weight_shape` (and `weight_offset`;
  workers/gguf/int4.py); every other tensor is dequantized (workers/gguf/dequant.py) and the
  loader casts it to the parameter's dtype.

Each tensor is handed over behind the same lazy-slice interface as safetensors' (`get_shape`,
indexing), so the loader's tensor-parallel slicing and checks apply unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from workers.gguf.config import PROJECTIONS
from workers.gguf.dequant import FORMATS, dequantize, q8_0_int8
from workers.gguf.int4 import int4_tensors
from workers.gguf.metadata import open_gguf, tensor_shape, type_name

if TYPE_CHECKING:
    from workers.config import ModelConfig

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Read into the model config, not into a module (workers/gguf/rope.py).
_CONFIG_ONLY = ("rope_freqs.weight",)
_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


def hf_name(name: str) -> tuple[str, str]:
    """(Hugging Face name, GGUF module part) of GGUF tensor `name`; ValueError if unknown."""
    m = _NAME.fullmatch(name)
    table = _GLOBAL if m is None or m.group(1) is None else _LAYER
    if m is None or m.group(2) not in table:
        raise ValueError(f"unexpected tensor {name!r} in the GGUF file")
    layer, part, suffix = m.groups()
    prefix = "" if layer is None else f"model.layers.{layer}."
    return f"{prefix}{table[part]}.{suffix}", part


def unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Q or K projection (or its bias) from llama.cpp's RoPE order back to Hugging
    Face's: within each head, GGUF row 2j + i is Hugging Face row i * head_dim / 2 + j."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class Converted:
    """A converted tensor behind safetensors' lazy-slice interface."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.t[index]


def _raw(tensor: Any) -> torch.Tensor:
    """The tensor's bytes, copied out of the memory map (torch wants a writable buffer)."""
    return torch.from_numpy(np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8).copy())


def gguf_tensors(c: ModelConfig) -> Iterator[tuple[str, Converted]]:
    """(checkpoint name, tensor) for every tensor of GGUF file `c.path`, in file order."""
    reader = open_gguf(c.path)
    quant = c.quantization
    int8 = quant is not None and quant.weights == "int8"
    int4 = quant is not None and quant.weights == "int4"
    # Heads whose rows llama.cpp permuted, by GGUF module part (Llama files only).
    heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}
    permuted = heads if c.architecture == "LlamaForCausalLM" else {}
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_ONLY:
            continue
        name, part = hf_name(tensor.name)
        fmt = FORMATS.get(int(tensor.tensor_type))
        if fmt is None:
            raise ValueError(
                f"{tensor.name}: GGUF type {type_name(int(tensor.tensor_type))} is not supported"
            )
        shape = tensor_shape(tensor)
        if int4 and part in PROJECTIONS and name.endswith(".weight"):
            assert quant is not None
            parts = int4_tensors(_raw(tensor), fmt, *shape, offset=quant.offset)
            stem = name.removesuffix("weight")
            for key, t in parts.items():
                if part in permuted and key != "weight_shape":  # rows, whatever they hold
                    t = unpermute(t, heads[part])
                yield stem + key, Converted(t)
            continue
        if int8 and part in PROJECTIONS and name.endswith(".weight"):
            if fmt.name != "Q8_0":
                raise ValueError(f"{tensor.name}: stored as {fmt.name}, expected Q8_0")
            weight, scale = q8_0_int8(_raw(tensor), *shape)
            if part in permuted:
                weight, scale = unpermute(weight, heads[part]), unpermute(scale, heads[part])
            yield name, Converted(weight)
            yield name.removesuffix("weight") + "weight_scale", Converted(scale)
            continue
        t = dequantize(_raw(tensor), fmt, shape)
        yield name, Converted(unpermute(t, heads[part]) if part in permuted else t)
