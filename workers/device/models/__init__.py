"""Model families. `build_model(config, tp, dtype, device)` picks one by architecture."""

from __future__ import annotations

import torch

from workers.config import ModelConfig
from workers.device.distributed import TPGroup


def build_model(config: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_pos: int):  # noqa: ANN201
    if config.gemma is not None:
        # Gemma 3: Llama's attention and linears, its own norms, MLP, embedding and ropes.
        from workers.device.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM(config, tp, dtype, max_pos)
    # Llama, Mistral, Qwen2 and Qwen3 differ only in flags (qkv bias, q/k norm, tying), and
    # Qwen3-MoE and Mixtral only in their sparse layers' MLP, so one implementation covers them.
    from workers.device.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(config, tp, dtype, max_pos)
