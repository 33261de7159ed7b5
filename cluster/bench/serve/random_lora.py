"""Random LoRA adapters for a checkpoint, in PEFT's format, for `kvray bench serve --workload
lora` (written without peft, which is only a test dependency).

An adapter directory holds what peft's `save_pretrained` writes for LoRA on a causal LM:
`adapter_config.json` ({"peft_type": "LORA", "r", "lora_alpha", "target_modules", "bias":
"none", "task_type": "CAUSAL_LM", ...}) and `adapter_model.safetensors` with, per decoder layer
i and projection, `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`
[r, in_features] and `.lora_B.weight` [out_features, r]. The projections are the attention's
q/k/v/o and the dense MLP's gate/up/down (attention only for a mixture-of-experts model, whose
MLP is its experts); their shapes come from the checkpoint's config.json.

Weights are seeded: A uniform in +-1/sqrt(in_features) (as a fresh adapter's A), B small normal
instead of peft's zeros, so each adapter changes the model's outputs a little and differently
(an all-zero B would make every adapter the base model). Outputs are meaningless; sizes,
memory traffic and FLOPs are a real adapter's of that rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_B_STD = 0.01
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoraShapes:
    """The decoder's projection sizes an adapter must match."""

    hidden: int
    q_out: int  # heads x head_dim
    kv_out: int  # kv heads x head_dim
    intermediate: int | None  # None: no dense MLP (mixture of experts)
    layers: int

    @staticmethod
    def from_config(config: dict[str, Any]) -> LoraShapes:
        """From a config.json's fields (head_dim, or hidden_size / num_attention_heads)."""
        if "hidden_size" not in config and "text_config" in config:
            raise ValueError("random adapters are written for text-only checkpoints")
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        moe = any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        return LoraShapes(
            hidden=hidden,
            q_out=heads * head_dim,
            kv_out=kv_heads * head_dim,
            intermediate=None if moe else int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
        )

    def modules(self) -> dict[str, tuple[str, int, int]]:
        """Target module -> (its block in a layer, in_features, out_features)."""
        h, q, kv = self.hidden, self.q_out, self.kv_out
        out = {
            "q_proj": ("self_attn", h, q),
            "k_proj": ("self_attn", h, kv),
            "v_proj": ("self_attn", h, kv),
            "o_proj": ("self_attn", q, h),
        }
        if self.intermediate is not None:
            i = self.intermediate
            out |= {"gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i)}
            out["down_proj"] = ("mlp", i, h)
        return out


def adapter_tensors(shapes: LoraShapes, rank: int, seed: int, dtype: str) -> dict[str, Any]:
    """The adapter's weights by peft key (module doc), seeded."""
    import torch

    if rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {rank}")
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shapes.layers):
        for name, (block, fan_in, fan_out) in shapes.modules().items():
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            bound = fan_in**-0.5
            a = (torch.rand(rank, fan_in, generator=g) * 2 - 1) * bound
            b = torch.randn(fan_out, rank, generator=g) * _B_STD
            tensors[f"{key}.lora_A.weight"] = a.to(dt).contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(dt).contiguous()
    return tensors


def adapter_config(shapes: LoraShapes, rank: int, base_model: str) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(shapes.modules()),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def write_random_adapter(
    model_dir: str | Path, out_dir: str | Path, rank: int = 16, seed: int = 0
) -> Path:
    """Writes one random adapter for the checkpoint in `model_dir` into `out_dir` (made, or
    replaced); in the checkpoint's dtype when it is a float one, else float32."""
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = LoraShapes.from_config(config)
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    dtype = dtype if dtype in _DTYPES else "float32"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(shapes, rank, seed, dtype)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config_text = json.dumps(adapter_config(shapes, rank, str(model_dir)), indent=2)
    (out / CONFIG_FILE).write_text(config_text + "\n")
    return out


def write_random_adapters(
    model_dir: str | Path, root: str | Path, names: list[str], rank: int = 16, seed: int = 0
) -> dict[str, Path]:
    """One adapter per name under `root` (root/name), adapter i seeded `seed + i`; an adapter
    already there with the same config is reused (its seed is in the directory name)."""
    out: dict[str, Path] = {}
    for i, name in enumerate(names):
        path = Path(root) / name
        config_file = path / CONFIG_FILE
        if not ((path / WEIGHTS_FILE).is_file() and config_file.is_file()):
            write_random_adapter(model_dir, path, rank=rank, seed=seed + i)
        elif json.loads(config_file.read_text()).get("r") != rank:
            write_random_adapter(model_dir, path, rank=rank, seed=seed + i)
        out[name] = path
    return out
