"""Random-weight checkpoints of real model shapes, for benchmarks (`--model random:NAME`).

Written in Hugging Face layout with the demo tokenizer, so kvray and transformers both load
them. Weights are seeded normal(0, 0.02) like a fresh initialisation; outputs are
meaningless, but shapes, memory traffic and FLOPs are the real model's.

`qwen3-moe-tiny` is Qwen3-30B-A3B's design scaled down to fit a small host twice over (kvray
and transformers each hold it in float32 in one `--compare` run): every expert, the router
and the attention are laid out as in the real model, with half its width (hidden 2048 ->
1024, moe_intermediate 768 -> 384, 32/4 -> 16/2 heads of 128), half its experts with the
same share active (128 top-8 -> 64 top-4), 8 of its 48 layers and a 32768-token vocabulary:
709M parameters, 110M active per token (LM head included). `intermediate_size` is top-k x
moe_intermediate, as in the real config (6144 = 8 x 768), so FLOP counts made from the dense
shape (cluster/bench/common/roofline.py) count the active experts.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Qwen3-shaped presets: name -> (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab)
PRESETS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "qwen3-100m": (768, 12, 12, 4, 64, 2048, 32768),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),
    # Small enough for tests (about 9M parameters, most of them the vocabulary's).
    "qwen3-tiny": (128, 2, 4, 2, 32, 256, 32768),
}
# Qwen3-MoE presets (see the module docstring):
# name -> (hidden, layers, heads, kv_heads, head_dim, experts, top_k, moe_intermediate, vocab)
MOE_PRESETS: dict[str, tuple[int, int, int, int, int, int, int, int, int]] = {
    "qwen3-moe-tiny": (1024, 8, 16, 2, 128, 64, 4, 384, 32768),
}
# Qwen3's context: long-prefix benchmarks (`bench kv-tier` at 4096 tokens and more) fit it.
MAX_POSITIONS = 40960


def random_model_dir(name: str, dtype: str = "bfloat16", cache_root: Path | None = None) -> Path:
    """Builds (once, cached) and returns the checkpoint directory of preset `name`."""
    if name not in PRESETS and name not in MOE_PRESETS:
        names = ", ".join([*PRESETS, *MOE_PRESETS])
        raise ValueError(f"unknown random model {name!r}; presets: {names}")
    from workers.demo import demo_model_dir

    root = cache_root or Path.home() / ".cache" / "kvray"
    out = root / f"random-{name}-{dtype}"
    config = _config(name, dtype)
    if (out / "model.safetensors").is_file():
        _refresh_config(out / "config.json", config)
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    demo = demo_model_dir()
    for f in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (demo / f).is_file():
            shutil.copy(demo / f, tmp / f)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(tmp / "model.safetensors", config, dtype)
    tmp.rename(out)
    return out


def _refresh_config(path: Path, config: dict[str, Any]) -> None:
    """A checkpoint cached before its context grew (4096 positions then) gets today's
    config.json; the weights do not depend on it."""
    old = json.loads(path.read_text())
    if old != config and {k: v for k, v in old.items() if k != "max_position_embeddings"} == {
        k: v for k, v in config.items() if k != "max_position_embeddings"
    }:
        path.write_text(json.dumps(config, indent=2))


def _config(name: str, dtype: str) -> dict[str, Any]:
    if name in MOE_PRESETS:
        hidden, layers, heads, kv, head_dim, experts, top_k, moe_inter, vocab = MOE_PRESETS[name]
        inter = top_k * moe_inter
        moe: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": moe_inter,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "tie_word_embeddings": False,
        }
    else:
        hidden, layers, heads, kv, head_dim, inter, vocab = PRESETS[name]
        moe = {}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "eos_token_id": 2,
        "bos_token_id": 0,
        **moe,
    }


def _write_weights(path: Path, c: dict[str, Any], dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dt)

    w = {
        "model.embed_tokens.weight": rnd(c["vocab_size"], h),
        "model.norm.weight": torch.ones(h, dtype=dt),
    }
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(c["vocab_size"], h)
    for i in tqdm(range(c["num_hidden_layers"]), desc="writing random weights", leave=False):
        p = f"model.layers.{i}."
        w.update(
            {
                p + "input_layernorm.weight": torch.ones(h, dtype=dt),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=dt),
                p + "self_attn.q_proj.weight": rnd(q, h),
                p + "self_attn.k_proj.weight": rnd(kv, h),
                p + "self_attn.v_proj.weight": rnd(kv, h),
                p + "self_attn.o_proj.weight": rnd(h, q),
                p + "self_attn.q_norm.weight": torch.ones(hd, dtype=dt),
                p + "self_attn.k_norm.weight": torch.ones(hd, dtype=dt),
            }
        )
        if "num_experts" not in c:
            w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
            w[p + "mlp.up_proj.weight"] = rnd(inter, h)
            w[p + "mlp.down_proj.weight"] = rnd(h, inter)
            continue
        moe_inter = c["moe_intermediate_size"]
        w[p + "mlp.gate.weight"] = rnd(c["num_experts"], h)
        for e in range(c["num_experts"]):
            w[p + f"mlp.experts.{e}.gate_proj.weight"] = rnd(moe_inter, h)
            w[p + f"mlp.experts.{e}.up_proj.weight"] = rnd(moe_inter, h)
            w[p + f"mlp.experts.{e}.down_proj.weight"] = rnd(h, moe_inter)
    save_file(w, str(path))
