"""Tiny random GGUF files for the GGUF tests, written with gguf-py's GGUFWriter the way
llama.cpp's converter lays them out: its tensor names, Llama's Q/K rows permuted for RoPE,
every matrix (embeddings and LM head included) in one GGML type, norms and biases in F32,
the demo checkpoint's byte-level BPE tokenizer embedded (`tokenizer.ggml.*`).

Q8_0 and Q4_0 (and the float types) are quantized by gguf-py from random float weights; gguf-py
cannot quantize K-quants, so Q4_K and Q6_K blocks are random bytes with finite float16 scales
chosen to give the weights the standard deviation the others have (the oracle, transformers,
dequantizes whatever bits are there). Shapes are multiples of 256 (a K-quant block).

The oracle (`load_hf_gguf`) is transformers' own GGUF loading, in float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

QTYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
_STD = 0.1  # weights' standard deviation: large enough that greedy outputs vary
_K_BYTES = {"Q4_K": 144, "Q6_K": 210}


@dataclass(frozen=True)
class GGUFSpec:
    arch: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int = 256
    inter: int = 512
    layers: int = 2
    bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # q/k RMSNorm (Qwen3)
    tied: bool = False  # no output.weight: the LM head is the embeddings


# Qwen3's head_dim is 128: transformers' GGUF loader does not read `attention.key_length` for
# it and falls back to Qwen3Config's default (128), so another value would mislead the oracle.
SPECS = {
    "llama": GGUFSpec("llama", heads=4, kv_heads=2, head_dim=64),
    "qwen2": GGUFSpec("qwen2", heads=4, kv_heads=2, head_dim=64, bias=True),
    "qwen3": GGUFSpec("qwen3", heads=2, kv_heads=1, head_dim=128, qk_norm=True, tied=True),
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a Llama Q or K projection's rows: within a head,
    Hugging Face row i * head_dim / 2 + j becomes row 2j + i."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def hf_weights(spec: GGUFSpec, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 weights under llama.cpp's tensor names, in Hugging Face's row order."""
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, _STD, (rows, cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + rng.normal(0, 0.1, n)).astype(np.float32)

    out = {"token_embd.weight": mat(vocab, h), "output_norm.weight": norm(h)}
    if not spec.tied:
        out["output.weight"] = mat(vocab, h)
    for i in range(spec.layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": norm(h), p + "ffn_norm.weight": norm(h)}
        out |= {p + "attn_q.weight": mat(q, h), p + "attn_k.weight": mat(kv, h)}
        out |= {p + "attn_v.weight": mat(kv, h), p + "attn_output.weight": mat(h, q)}
        out |= {p + "ffn_gate.weight": mat(spec.inter, h), p + "ffn_up.weight": mat(spec.inter, h)}
        out[p + "ffn_down.weight"] = mat(h, spec.inter)
        if spec.bias:
            for part, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                out[p + f"{part}.bias"] = rng.normal(0, 0.1, n).astype(np.float32)
        if spec.qk_norm:
            out[p + "attn_q_norm.weight"] = norm(spec.head_dim)
            out[p + "attn_k_norm.weight"] = norm(spec.head_dim)
    return out


def random_k_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K bytes [rows, cols / 256 * block bytes] whose values have std ~_STD."""
    import gguf

    nbytes = _K_BYTES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // 256, nbytes), dtype=np.uint8)
    one = np.ones(len(blocks), dtype=np.float16).view(np.uint8).reshape(-1, 2)
    scale_at = (0, 2) if qtype == "Q4_K" else (208,)  # d (and Q4_K's dmin)
    for at in scale_at:
        blocks[:, at : at + 2] = one
    if qtype == "Q4_K":  # sub-block scales 1..8 and mins 7.5x theirs: values centred on zero
        sc = rng.integers(1, 9, (len(blocks), 8))
        blocks[:, 4:16] = pack_q4_k_scales(sc, np.rint(sc * 7.5).astype(np.int64))
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    std = float(gguf.quants.dequantize(blocks, qt).std())
    d = np.full(len(blocks), _STD / std, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    for at in scale_at:
        blocks[:, at : at + 2] = d
    return blocks.reshape(rows, -1)


def pack_q4_k_scales(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_K's 12 scale bytes of 8 sub-blocks' 6-bit scales and mins [n, 8] each: sub-blocks
    0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in bytes 8-11's low
    (scale) and high (min) nibbles, their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    out = np.zeros((len(sc), 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mins[:, 4:] & 0xF) << 4)
    return out


def _add_tensor(
    writer: Any, name: str, w: np.ndarray, qtype: str, rng: np.random.Generator
) -> None:
    import gguf

    if w.ndim == 1 or qtype == "F32":
        writer.add_tensor(name, w)
    elif qtype == "F16":
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype == "BF16":
        bf16 = gguf.GGMLQuantizationType.BF16
        writer.add_tensor(name, gguf.quants.quantize(w, bf16), raw_dtype=bf16)
    elif qtype in _K_BYTES:
        qt = getattr(gguf.GGMLQuantizationType, qtype)
        writer.add_tensor(name, random_k_blocks(qtype, *w.shape, rng), raw_dtype=qt)
    else:
        qt = getattr(gguf.GGMLQuantizationType, qtype)
        writer.add_tensor(name, gguf.quants.quantize(w, qt), raw_dtype=qt)


def _add_tokenizer(writer: Any, tokenizer_dir: Path) -> int:
    """The demo tokenizer as `tokenizer.ggml.*` (GPT-2-style byte-level BPE); its vocab size."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    ids = dict(tok["model"]["vocab"])
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    ids |= {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens = [""] * (max(ids.values()) + 1)
    for text, i in ids.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the demo tokenizer splits with GPT-2's regex
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # CONTROL / NORMAL
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ids[cfg["bos_token"]])
    writer.add_eos_token_id(ids[cfg["eos_token"]])
    writer.add_chat_template(cfg["chat_template"])
    return len(tokens)


def make_gguf(
    path: Path,
    arch: str,
    qtype: str,
    *,
    seed: int = 0,
    tokenizer: bool = True,
    metadata: dict[str, Any] | None = None,
    types: dict[str, str] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write a tiny random GGUF file of `arch` (SPECS) whose matrices are `qtype` (QTYPES,
    F32, F16 or gguf-py's other quantizable types); `types`: other types for some tensors by
    name; `metadata`: extra key/values and `extra`: extra F32 tensors (tests of refusals);
    `tokenizer`: embed the demo's."""
    import gguf

    from workers.demo import demo_model_dir

    spec = SPECS[arch]
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"kvray-test-{arch}")
    if tokenizer:
        vocab = _add_tokenizer(writer, demo_model_dir())
    else:
        vocab = 4096
    writer.add_context_length(512)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.inter)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in (metadata or {}).items():
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            add[type(value)](key, value)
    for name, w in hf_weights(spec, vocab, rng).items():
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            w = llama_cpp_permute(w, spec.heads if "attn_q" in name else spec.kv_heads)
        _add_tensor(writer, name, w, (types or {}).get(name, qtype), rng)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_hf_gguf(path: Path) -> Any:
    """transformers' model of GGUF file `path` (dequantized by gguf-py), float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


# Hugging Face module names -> llama.cpp's, for `hf_to_gguf` (a converter's table, written here
# apart from kvray's reverse one in workers/gguf/tensors.py).
_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama3_rope_factors(theta: float, head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs.weight` for a `llama3` rope scaling:
    per rotary frequency, the divisor the llama3 rule applies to it."""
    import math

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_to_gguf(hf_dir: Path, path: Path, random_projections: str | None = None) -> Path:
    """A float32 GGUF file of Hugging Face checkpoint `hf_dir` (Llama, Mistral, Qwen2, Qwen3),
    laid out as llama.cpp's converter lays it out: Llama's (and Mistral's, arch `llama`) Q/K rows
    permuted, a `llama3` rope scaling as `rope_freqs.weight`, a linear one as
    `rope.scaling.*`, the checkpoint's tokenizer embedded.

    `random_projections` ("Q4_K", "Q6_K"): every projection weight is random blocks of that
    type instead (`random_k_blocks`), for speed measurements: gguf-py cannot quantize K-quants."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = "llama" if cfg["model_type"] == "mistral" else cfg["model_type"]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {
        **(cfg.get("rope_scaling") or {}),
        "rope_theta": cfg["rope_theta"],
    }
    writer = gguf.GGUFWriter(str(path), arch)
    _add_tokenizer(writer, hf_dir)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope_type == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_factors(rope["rope_theta"], head_dim, rope)
        )
    tensors: dict[str, Any] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors |= load_file(str(f))
    rng = np.random.default_rng(0)
    for name, t in tensors.items():
        module, suffix = name.rsplit(".", 1)
        part = module.split(".", 3)[-1] if module.startswith("model.layers.") else None
        if part is None:
            gguf_name = f"{_TO_GGUF[module]}.{suffix}"
        else:
            gguf_name = f"blk.{module.split('.')[2]}.{_LAYER_TO_GGUF[part]}.{suffix}"
        w = t.float().numpy()  # (bfloat16 has no numpy dtype)
        projection = part is not None and part.endswith("_proj") and suffix == "weight"
        if random_projections and projection:
            qt = getattr(gguf.GGMLQuantizationType, random_projections)
            blocks = random_k_blocks(random_projections, *w.shape, rng)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qt)
            continue
        if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            w = llama_cpp_permute(w, heads if part == "self_attn.q_proj" else kv_heads)
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
