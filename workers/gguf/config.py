"""A GGUF file's architecture metadata as the config.json kvray reads (workers/config.py), so a
.gguf model goes through the same checks, defaults and model code as a Hugging Face directory.

GGUF keys follow llama.cpp's conventions: `<arch>.embedding_length` is hidden_size,
`<arch>.attention.key_length` head_dim (default hidden / heads, as llama.cpp derives it), and
so on. Refused at start-up, naming what: an architecture other than llama (Llama, Mistral),
qwen2 and qwen3; mixture-of-experts files; a tensor type kvray does not read (workers/gguf/
dequant.py FORMATS); partial rotary; RoPE scaling other than linear, or Llama 3.1+
`rope_freqs` factors that do not follow llama3 scaling (workers/gguf/rope.py reads those).

Quantization (`quantization_config` with quant_method "gguf", workers/quantization.py):
projections all Q8_0 stay int8 in memory with their scale per 32 columns (W8A16,
workers/device/layers/int8_linear.py); projections all Q4_0 or Q4_K stay 4-bit, packed eight to
an int32 with a scale (and, with any Q4_K, a float offset) per 32 columns (W4A16,
workers/device/layers/int4_linear.py, workers/gguf/int4.py). The decision is per file: the
model builds one kind of projection layer, so a file that mixes types among its projections
(llama.cpp's Q4_K_M, whose Q6_K attn_v and ffn_down have no layer) is dequantized into the
compute dtype at load, as Q6_K files are; a float-only file is full precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.gguf.dequant import FLOAT_TYPES, FORMATS, INT4_GROUP, INT4_TYPES, Q8_0_GROUP
from workers.gguf.metadata import field, open_gguf, tensor_shape, type_name
from workers.gguf.rope import llama3_from_factors

ARCHITECTURES = {  # GGUF general.architecture -> the model class kvray builds
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_REQUIRED = object()
NO_TOKENIZER = (
    "{path} embeds no tokenizer (no tokenizer.ggml.tokens): pass a Hugging Face tokenizer "
    "directory with --tokenizer (EngineArgs / LLM tokenizer=...)"
)
# Tensor name parts of the attention and MLP projections (workers/gguf/tensors.py).
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_config(path: str | Path, needs_tokenizer: bool = False) -> dict[str, Any]:
    """config.json's keys for the model in GGUF file `path`; `needs_tokenizer`: refuse a file
    that embeds none (no --tokenizer was given), before any worker starts."""
    reader = open_gguf(path)
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; kvray serves GGUF files of "
            f"{', '.join(ARCHITECTURES)}"
        )
    if needs_tokenizer and field(reader, "tokenizer.ggml.tokens", None) is None:
        raise ValueError(NO_TOKENIZER.format(path=path))
    tensors = {t.name: t for t in reader.tensors}
    _check_types(path, tensors)

    def key(name: str, default: Any = _REQUIRED) -> Any:
        """Metadata `<arch>.<name>`; a per-layer list must hold one value (kvray's layers
        are all alike)."""
        try:
            value = field(reader, f"{arch}.{name}", *(() if default is _REQUIRED else (default,)))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{path}: per-layer {arch}.{name} {value} is not supported")
            value = value[0]
        return value

    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")

    if key("expert_count", 0):
        raise ValueError(f"{path}: mixture-of-experts GGUF files are not supported yet")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = key("rope.dimension_count", None)
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(
            f"{path}: {arch}.rope.dimension_count {rotary} != head_dim {head_dim} (partial "
            "rotary embeddings are not supported)"
        )
    architecture, model_type = ARCHITECTURES[arch]
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(key("feed_forward_length")),
        "vocab_size": tensor_shape(tensors["token_embd.weight"])[0],
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": _float_dtype(tensors),
    }
    cfg.update(_rope_scaling(path, key))
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: llama3 scaling as per-frequency factors
        if arch != "llama" or "rope_scaling" in cfg:
            raise ValueError(
                f"{path}: tensor 'rope_freqs.weight' is only read in a llama file "
                "without rope.scaling.type"
            )
        factors = tensors["rope_freqs.weight"].data
        where = f"{path}: rope_freqs.weight"
        cfg["rope_scaling"] = llama3_from_factors(factors, cfg["rope_theta"], head_dim, where)
    for which in ("bos", "eos"):
        token = field(reader, f"tokenizer.ggml.{which}_token_id", None)
        if token is not None:
            cfg[f"{which}_token_id"] = int(token)
    quant = _quantization(tensors)
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def _check_types(path: str | Path, tensors: dict[str, Any]) -> None:
    for name, t in tensors.items():
        if int(t.tensor_type) not in FORMATS:
            supported = ", ".join(f.name for f in FORMATS.values())
            raise ValueError(
                f"{path}: tensor {name!r} has GGUF type {type_name(int(t.tensor_type))}, which "
                f"kvray does not read (supported: {supported})"
            )


def _rope_scaling(path: str | Path, key: Any) -> dict[str, Any]:
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind == "linear":
        return {
            "rope_scaling": {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        }
    raise ValueError(f"{path}: rope.scaling.type {kind!r} is not supported (none, linear)")


def _float_dtype(tensors: dict[str, Any]) -> str:
    """The checkpoint dtype (what `dtype="auto"` follows on CUDA): bfloat16 or float16 when
    the file stores its float matrices so, float32 otherwise (quantized files included)."""
    names = {FORMATS[int(t.tensor_type)].name for t in tensors.values() if len(t.shape) > 1}
    for name in ("BF16", "F16"):
        if name in names:
            return str(FLOAT_TYPES[name]).removeprefix("torch.")
    return "float32"


def _quantization(tensors: dict[str, Any]) -> dict[str, Any] | None:
    """quantization_config for a file with quantized projections (None: none are)."""
    types = {
        FORMATS[int(t.tensor_type)].name
        for name, t in tensors.items()
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS
    }
    if not types - set(FLOAT_TYPES):
        return None
    if types == {"Q8_0"}:
        weights = "int8"
    elif types <= set(INT4_TYPES):
        weights = "int4"
    else:
        weights = "dequantized"
    return {"quant_method": "gguf", "types": sorted(types), "weights": weights}


def gguf_quantization_fields(raw: dict[str, Any], requested: str) -> dict[str, Any] | None:
    """QuantizationConfig's fields for a GGUF file's projections (workers/quantization.py):
    int8 W8A16 for Q8_0, int4 W4A16 for Q4_0 / Q4_K (float offsets with any Q4_K), None
    (compute dtype, dequantized at load) for the others.
    `requested` "none" is refused by the caller; "fp8" here."""
    if requested == "fp8":
        raise ValueError(
            f"quantization 'fp8' needs an FP8 checkpoint, and this GGUF file's projections are "
            f"{', '.join(raw.get('types', []))}; use 'auto' to serve it"
        )
    if raw.get("weights") == "int4":
        return {
            "method": "gguf",
            "weight_block_size": (1, INT4_GROUP),
            "strategy": "group",
            "scale_name": "weight_scale",
            "weights": "int4",
            "offset": "Q4_K" in raw.get("types", ()),
        }
    if raw.get("weights") != "int8":
        return None
    return {
        "method": "gguf",
        "weight_block_size": (1, Q8_0_GROUP),
        "strategy": "group",
        "scale_name": "weight_scale",
        "weights": "int8",
    }
