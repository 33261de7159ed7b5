"""Tiny random mixture-of-experts Hugging Face checkpoints for parity tests.

`make_moe_checkpoint(kind, path, ...)` writes a complete HF model directory, as
`tests.checkpoints.make_checkpoint` does for the dense families (same tokenizer, weight scales
and writer), for one of MOE_KINDS:

- qwen3_moe: Qwen3 attention (q/k RMSNorm, head_dim != hidden/heads), untied LM head, the
  router `mlp.gate` and experts `mlp.experts.M.{gate,up,down}_proj`; `mlp_only_layers` and
  `decoder_sparse_step` make some layers dense (`intermediate_size`), `norm_topk_prob`
  renormalises the top-k weights;
- mixtral: Mistral attention (GQA, old config spelling), `block_sparse_moe.gate` and experts
  `block_sparse_moe.experts.M.{w1,w3,w2}`; the top-k weights always renormalised.

Expert counts, top-k and the other MoE settings are arguments, so a test picks the routing it
exercises. Seeded: the same call writes the same bytes.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.checkpoints import (
    Spelling,
    _config,
    _copy_tokenizer,
    _Spec,
    _weights,
    _write_weights,
    write_config,
)

MOE_KINDS = ("qwen3_moe", "mixtral")

_WEIGHT_STD = 0.15  # as tests.checkpoints: logits far from uniform, routing far from ties

_SPECS: dict[str, _Spec] = {
    "qwen3_moe": _Spec(
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        rope={"rope_type": "default", "rope_theta": 1000000.0},
        default_spelling="new",
        hidden_size=64,
        intermediate_size=96,  # the dense layers' (mlp_only_layers, decoder_sparse_step)
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,  # != 64 / 4
        qk_norm=True,
        extra_config={"attention_bias": False, "use_sliding_window": False},
    ),
    "mixtral": _Spec(
        architecture="MixtralForCausalLM",
        model_type="mixtral",
        rope={"rope_type": "default", "rope_theta": 1000000.0},
        default_spelling="old",
        hidden_size=64,
        intermediate_size=48,  # of one expert
        num_heads=4,
        num_kv_heads=2,
        rms_norm_eps=1e-5,
        extra_config={"sliding_window": None, "router_jitter_noise": 0.0},
    ),
}


def make_moe_checkpoint(
    kind: str,
    path: Path,
    *,
    num_experts: int = 4,
    top_k: int = 2,
    num_layers: int = 2,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (),
    decoder_sparse_step: int = 1,
    moe_intermediate_size: int = 32,
    sharded: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    config_spelling: Spelling | None = None,
) -> Path:
    """Write a tiny random MoE checkpoint of `kind` (one of MOE_KINDS) into `path`.

    norm_topk_prob, mlp_only_layers, decoder_sparse_step and moe_intermediate_size are
    Qwen3-MoE settings (Mixtral has none of them: every layer is sparse, its experts
    `intermediate_size` wide). config_spelling: config.json written as it is, in transformers
    4.x's spelling ("old": rope_theta, and Qwen3-MoE's expert count as `num_experts`) or 5.x's
    ("new": rope_parameters, `num_local_experts`); None: saved by the installed transformers
    (tests.checkpoints.write_config). Mixtral's expert count is `num_local_experts` in both."""
    if kind not in _SPECS:
        raise ValueError(f"kind must be one of {sorted(_SPECS)}, got {kind!r}")
    spec = replace(_SPECS[kind], num_layers=num_layers)
    from workers.demo import demo_model_dir

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size, special_ids = _copy_tokenizer(demo_model_dir(), path)
    spelling = config_spelling or spec.default_spelling
    config = {
        **_config(spec, spelling, vocab_size, special_ids),
        "torch_dtype": dtype,
        "num_experts_per_tok": top_k,
    }
    new_names = kind == "mixtral" or spelling == "new"
    config["num_local_experts" if new_names else "num_experts"] = num_experts
    if kind == "mixtral":
        sparse = list(range(num_layers))
        inter, names, block = spec.intermediate_size, ("w1", "w3", "w2"), "block_sparse_moe"
    else:
        config.update(
            norm_topk_prob=norm_topk_prob,
            mlp_only_layers=list(mlp_only_layers),
            decoder_sparse_step=decoder_sparse_step,
            moe_intermediate_size=moe_intermediate_size,
        )
        sparse = [
            i
            for i in range(num_layers)
            if i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
        ]
        inter, names, block = moe_intermediate_size, ("gate_proj", "up_proj", "down_proj"), "mlp"
    write_config(path, config, as_written=config_spelling is not None)
    seed = seed * 1000003 + zlib.crc32(kind.encode())
    tensors = _weights(spec, vocab_size, seed=seed)
    tensors.update(_experts(spec.hidden_size, inter, num_experts, sparse, names, block, seed))
    for i in sparse:  # the dense MLP's tensors of a sparse layer: not in such a checkpoint
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del tensors[f"model.layers.{i}.mlp.{proj}.weight"]
    import torch

    tensors = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
    _write_weights(tensors, path, sharded=sharded)
    return path


def _experts(
    hidden: int,
    inter: int,
    num_experts: int,
    sparse: list[int],
    names: tuple[str, str, str],
    block: str,
    seed: int,
) -> dict[str, Any]:
    """Router and expert weights of the sparse layers."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * _WEIGHT_STD

    gate, up, down = names
    t: dict[str, torch.Tensor] = {}
    for i in sparse:
        p = f"model.layers.{i}.{block}"
        t[f"{p}.gate.weight"] = normal(num_experts, hidden)
        for e in range(num_experts):
            t[f"{p}.experts.{e}.{gate}.weight"] = normal(inter, hidden)
            t[f"{p}.experts.{e}.{up}.weight"] = normal(inter, hidden)
            t[f"{p}.experts.{e}.{down}.weight"] = normal(hidden, inter)
    return t
