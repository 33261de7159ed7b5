"""Tiny random Gemma 3 (`Gemma3ForCausalLM`) Hugging Face checkpoints for parity tests.

`make_gemma_checkpoint(path, ...)` writes a complete HF model directory, as
`tests.checkpoints.make_checkpoint` does for the Llama families (same tokenizer, weight scale
and writer). Each choice makes one of Gemma's differences observable:

- layers mix sliding and full attention (`layer_types` in the new spelling, or
  `sliding_window_pattern` in the old one) and the two rope bases differ widely (local 10,000,
  global 1,000,000 with linear scaling): a layer given the wrong base changes the tokens;
- the sliding window (256) exceeds every test prompt plus its output, so full causal
  attention is exact, while max_position_embeddings (512) is larger, so the engine's cap to
  the window shows;
- every norm weight is random and non-zero (Gemma's norm is x * (1 + w), zero-initialised in
  transformers), so a loader that forgets the 1 + w, or a norm, is caught;
- head_dim (48) != hidden / heads (32) and query_pre_attn_scalar (64) != head_dim;
- tied embeddings (Gemma's default).

Seeded: the same call writes the same bytes.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Literal

from tests.checkpoints import _copy_tokenizer, _write_weights, write_config

# Chosen so that greedy outputs vary (measured: most of 12 tokens distinct). With
# tests.checkpoints' scales (0.15 everywhere, norm weights near 1) a random Gemma repeats one
# token: the sqrt(hidden)-scaled embedding dominates the residual stream, and the tied LM head
# then favours the token just read. A smaller embedding, larger post-attention /
# post-feedforward norms (what each layer adds) and widely spread norm weights fix that.
_WEIGHT_STD = 0.15
_EMBED_STD = 0.05
_NORM_STD = 1.0  # w of x * (1 + w)
_POST_NORM_MEAN = 2.0

HIDDEN, INTER, HEADS, HEAD_DIM = 128, 256, 4, 48
SLIDING_WINDOW = 256
MAX_POSITIONS = 512
LOCAL_THETA, GLOBAL_THETA = 10_000.0, 1_000_000.0


def make_gemma_checkpoint(
    path: Path,
    *,
    spelling: Literal["old", "new"] | None = None,
    layer_types: tuple[str, ...] = (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    ),
    sliding_window_pattern: int = 3,
    num_layers: int = 4,
    num_kv_heads: int = 2,
    query_pre_attn_scalar: int = 64,
    global_rope_factor: float = 2.0,
    sharded: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random Gemma 3 checkpoint into `path` and return it.

    spelling "new": `rope_parameters` keyed by layer type and `layer_types` (its length is the
    layer count; num_layers is then ignored); "old": `rope_theta`, `rope_local_base_freq`,
    `rope_scaling` and `sliding_window_pattern` (transformers: layer i slides unless (i + 1)
    is a multiple of it) over `num_layers` layers; either written as it is. None: the new
    spelling saved by the installed transformers (tests.checkpoints.write_config).
    global_rope_factor: the global layers' linear rope scaling (1: none). extra_config: keys
    added to config.json last."""
    from workers.demo import demo_model_dir

    written, spelling = spelling, spelling or "new"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size, special_ids = _copy_tokenizer(demo_model_dir(), path)
    layers = len(layer_types) if spelling == "new" else num_layers
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": num_kv_heads,
        "head_dim": HEAD_DIM,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": SLIDING_WINDOW,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        **special_ids,
    }
    scaling = {"rope_type": "linear", "factor": global_rope_factor}
    if spelling == "new":
        full = {"rope_type": "default", "rope_theta": GLOBAL_THETA}
        if global_rope_factor != 1.0:
            full = {**scaling, "rope_theta": GLOBAL_THETA}
        config["layer_types"] = list(layer_types)
        config["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA},
            "full_attention": full,
        }
    else:
        config["rope_theta"] = GLOBAL_THETA
        config["rope_local_base_freq"] = LOCAL_THETA
        config["rope_scaling"] = None if global_rope_factor == 1.0 else scaling
        config["sliding_window_pattern"] = sliding_window_pattern
    config.update(extra_config or {})
    write_config(path, config, as_written=written is not None)
    tensors = _weights(layers, num_kv_heads, vocab_size, seed * 1000003 + zlib.crc32(b"gemma3"))
    import torch

    tensors = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
    _write_weights(tensors, path, sharded=sharded)
    return path


def _weights(layers: int, kv_heads: int, vocab_size: int, seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = _WEIGHT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def post_norm() -> torch.Tensor:
        return _POST_NORM_MEAN + normal(HIDDEN, std=_NORM_STD)

    q_out, kv_out = HEADS * HEAD_DIM, kv_heads * HEAD_DIM
    embed = normal(vocab_size, HIDDEN, std=_EMBED_STD)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = normal(HIDDEN, std=_NORM_STD)
        t[f"{p}.self_attn.q_proj.weight"] = normal(q_out, HIDDEN)
        t[f"{p}.self_attn.k_proj.weight"] = normal(kv_out, HIDDEN)
        t[f"{p}.self_attn.v_proj.weight"] = normal(kv_out, HIDDEN)
        t[f"{p}.self_attn.o_proj.weight"] = normal(HIDDEN, q_out)
        t[f"{p}.self_attn.q_norm.weight"] = normal(HEAD_DIM, std=_NORM_STD)
        t[f"{p}.self_attn.k_norm.weight"] = normal(HEAD_DIM, std=_NORM_STD)
        t[f"{p}.post_attention_layernorm.weight"] = post_norm()
        t[f"{p}.pre_feedforward_layernorm.weight"] = normal(HIDDEN, std=_NORM_STD)
        t[f"{p}.post_feedforward_layernorm.weight"] = post_norm()
        t[f"{p}.mlp.gate_proj.weight"] = normal(INTER, HIDDEN)
        t[f"{p}.mlp.up_proj.weight"] = normal(INTER, HIDDEN)
        t[f"{p}.mlp.down_proj.weight"] = normal(HIDDEN, INTER)
    t["model.norm.weight"] = normal(HIDDEN, std=_NORM_STD)
    return t
