"""Gemma 3 settings of a checkpoint (`Gemma3ForCausalLM`, model_type "gemma3_text"), read from
config.json as transformers' Gemma3TextConfig reads them.

What Gemma 3 adds to the Llama layout: the attention scale `query_pre_attn_scalar ** -0.5`,
sliding-window layers (local rotary base `rope_local_base_freq`) among global ones (the main
rope, with its scaling), and a GeGLU MLP. Absent keys take transformers' defaults for the
family (`with_gemma_defaults`), so a checkpoint serves with the model transformers would build.

Refused, with the field named: attention or final logit soft-capping (Gemma 2's; the paged
attention's SDPA and the C kernels have no soft-cap), bidirectional attention, activations
other than gelu_pytorch_tanh, attention biases (no Gemma 3 checkpoint has them; the o
projection would need one too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.rope_config import RopeConfig

GEMMA_ARCHITECTURES = ("Gemma3ForCausalLM",)

SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' Gemma3TextConfig defaults for the keys ModelConfig reads with Llama defaults.
_DEFAULTS: dict[str, Any] = {
    "tie_word_embeddings": True,
    "head_dim": 256,
    "num_key_value_heads": 4,
    "intermediate_size": 9216,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' default_theta
_PATTERN = 6  # sliding_window_pattern's default: five local layers, then a global one


def with_gemma_defaults(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with transformers' Gemma 3 defaults for absent keys, and no `sliding_window` when no
    layer slides (the engine caps max_model_len to the window); other architectures' configs
    unchanged."""
    if arch not in GEMMA_ARCHITECTURES:
        return cfg
    cfg = {**_DEFAULTS, **cfg}
    if "num_hidden_layers" in cfg and not _sliding_layers(cfg, int(cfg["num_hidden_layers"])):
        cfg["sliding_window"] = None
    return cfg


@dataclass(frozen=True)
class GemmaConfig:
    query_pre_attn_scalar: float  # attention scale: query_pre_attn_scalar ** -0.5
    sliding_layers: tuple[int, ...]  # layers of type sliding_attention (local rope)
    local_rope: RopeConfig  # the sliding layers' rotary (rope_local_base_freq)
    global_rope: RopeConfig  # the full-attention layers' (rope_theta, rope_scaling)

    def is_sliding(self, layer: int) -> bool:
        return layer in self.sliding_layers

    @property
    def scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    @staticmethod
    def from_hf(arch: str, cfg: dict[str, Any]) -> GemmaConfig | None:
        """The Gemma 3 settings of `arch`, or None for another architecture. Raises ValueError
        naming the field for what the engine cannot run."""
        if arch not in GEMMA_ARCHITECTURES:
            return None
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                raise ValueError(
                    f"{key} is {cfg[key]!r}: soft-capping is not supported (the paged "
                    "attention's SDPA and the CPU kernels have no soft-cap); Gemma 3 "
                    "checkpoints set it to null"
                )
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported: attention is causal")
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported: gelu_pytorch_tanh only")
        if cfg.get("attention_bias"):
            raise ValueError("attention_bias is not supported for Gemma3ForCausalLM")
        local, full = _rope_parameters(cfg)
        return GemmaConfig(
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            sliding_layers=_sliding_layers(cfg, int(cfg["num_hidden_layers"])),
            local_rope=RopeConfig.from_hf({"rope_parameters": local}),
            global_rope=RopeConfig.from_hf({"rope_parameters": full}),
        )


def _sliding_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """`layer_types` when given, else transformers' rule for `sliding_window_pattern`: layer i
    slides unless (i + 1) is a multiple of the pattern."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or _PATTERN)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(
            f"layer_types must list {num_layers} entries of {SLIDING!r} or {FULL!r}, got {types!r}"
        )
    return tuple(i for i, t in enumerate(types) if t == SLIDING)


def _rope_parameters(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(local, global) rope parameters from either spelling: `rope_parameters` keyed by layer
    type (new), or `rope_theta` + `rope_scaling` for the global layers and
    `rope_local_base_freq` for the local ones (old); the scaling applies to global layers only."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        local = dict(params.get(SLIDING) or {})
        full = dict(params.get(FULL) or {})
    else:
        local = {}
        full = dict(cfg.get("rope_scaling") or {})
        if cfg.get("rope_theta") is not None:
            full.setdefault("rope_theta", cfg["rope_theta"])
        if cfg.get("rope_local_base_freq") is not None:
            local["rope_theta"] = cfg["rope_local_base_freq"]
    local.setdefault("rope_type", "default")
    local.setdefault("rope_theta", _LOCAL_THETA)
    full.setdefault("rope_theta", _GLOBAL_THETA)
    return local, full
