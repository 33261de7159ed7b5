"""Mixture-of-experts settings of a checkpoint (Qwen3-MoE, Mixtral), read from config.json.

Absent keys take transformers' defaults for the family, so a checkpoint serves with the
routing transformers would give it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # of one expert
    # Divide the top-k probabilities by their sum (Qwen3-MoE: `norm_topk_prob`; Mixtral: always).
    renormalize: bool
    # Cast the routing weights to the model's dtype before scaling expert outputs (Qwen3-MoE),
    # or scale in float32 and cast the product (Mixtral): transformers' order in each family.
    weights_in_model_dtype: bool
    sparse_layers: tuple[int, ...]  # layers whose MLP is the MoE block; the others are dense
    # How the checkpoint names a layer's block: "mlp" + gate_proj/up_proj/down_proj
    # (Qwen3-MoE) or "block_sparse_moe" + w1/w3/w2 (Mixtral).
    block_name: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Expert parallelism over the TP group (the engine's `enable_expert_parallel`): each rank
    # holds whole experts, 1/tp of them, instead of a 1/tp slice of every expert.
    expert_parallel: bool = False

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def check_tensor_parallel(self, tp_size: int) -> None:
        if self.expert_parallel:
            if self.num_experts % tp_size:
                raise ValueError(
                    f"expert parallelism: the number of experts ({self.num_experts}) is not "
                    f"divisible by tensor_parallel_size ({tp_size})"
                )
            return
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"the experts' intermediate size ({self.intermediate_size}) is not divisible "
                f"by tensor_parallel_size ({tp_size})"
            )

    @staticmethod
    def from_hf(arch: str, cfg: dict[str, Any], num_layers: int) -> MoeConfig | None:
        """The MoE settings of `arch`, or None for a dense architecture."""
        if arch == "Qwen3MoeForCausalLM":
            num_experts = int(cfg.get("num_experts", 128))
            step = int(cfg.get("decoder_sparse_step", 1))
            dense = set(cfg.get("mlp_only_layers") or ())
            # transformers: sparse where not in mlp_only_layers and (i + 1) % step == 0.
            sparse = tuple(
                i
                for i in range(num_layers)
                if i not in dense and num_experts > 0 and step > 0 and (i + 1) % step == 0
            )
            return MoeConfig(
                num_experts=num_experts,
                top_k=int(cfg.get("num_experts_per_tok", 8)),
                intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
                renormalize=bool(cfg.get("norm_topk_prob", False)),
                weights_in_model_dtype=True,
                sparse_layers=sparse,
            )._checked()
        if arch == "MixtralForCausalLM":
            return MoeConfig(
                num_experts=int(cfg.get("num_local_experts", 8)),
                top_k=int(cfg.get("num_experts_per_tok", 2)),
                intermediate_size=int(cfg.get("intermediate_size", 14336)),
                renormalize=True,
                weights_in_model_dtype=False,
                sparse_layers=tuple(range(num_layers)),
                block_name="block_sparse_moe",
                expert_names=("w1", "w3", "w2"),
            )._checked()
        return None

    def _checked(self) -> MoeConfig:
        if self.sparse_layers and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of "
                f"experts ({self.num_experts})"
            )
        return self
