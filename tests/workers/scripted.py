"""A "scripted" Llama checkpoint whose greedy output is a chosen token sequence.

All transformer blocks are zero (the residual stream carries the embedding through), token
t_k embeds as the one-hot vector e_k and the LM head maps e_k to a large logit for t_{k+1}.
So from prompt [t_0] the model emits t_1, t_2, ... exactly: a deterministic way to make a real
model stream chosen text (Korean, emoji split across tokens) through the real engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_scripted_checkpoint(path: Path, tokenizer_dir: Path, chain: list[int], eos: int) -> Path:
    """chain[0] is the prompt token; the model then emits chain[1:], then `eos`."""
    if len(set(chain)) != len(chain):
        raise ValueError("chain tokens must be distinct")
    path.mkdir(parents=True, exist_ok=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    hidden, layers, heads, inter = 64, 1, 2, 64
    assert len(chain) <= hidden
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": eos,
        "bos_token_id": eos,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    embed = torch.zeros(vocab, hidden)
    head = torch.zeros(vocab, hidden)
    for k, tok in enumerate(chain):
        embed[tok, k] = 1.0
        head[chain[k + 1] if k + 1 < len(chain) else eos, k] = 30.0
    w = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": head,
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[p + f"self_attn.{n}.weight"] = torch.zeros(hidden, hidden)
        w[p + "mlp.gate_proj.weight"] = torch.zeros(inter, hidden)
        w[p + "mlp.up_proj.weight"] = torch.zeros(inter, hidden)
        w[p + "mlp.down_proj.weight"] = torch.zeros(hidden, inter)
    save_file(w, str(path / "model.safetensors"))
    return path
