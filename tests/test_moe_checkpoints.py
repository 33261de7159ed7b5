"""The MoE parity checkpoints load cleanly in transformers, with the routing they claim."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.checkpoints import hf_greedy
from tests.moe_checkpoints import MOE_KINDS, make_moe_checkpoint


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_loads_with_every_weight_used(kind: str, tmp_path: Path) -> None:
    path = make_moe_checkpoint(kind, tmp_path, num_experts=8, top_k=2, num_layers=3, sharded=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    # Expert 5 of layer 2 reached transformers' stacked weights unchanged.
    names = {
        "qwen3_moe": ("mlp", "gate_proj", "down_proj"),
        "mixtral": ("block_sparse_moe", "w1", "w2"),
    }
    prefix, gate_name, down_name = names[kind]
    files = sorted(path.glob("*.safetensors"))
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            tensors.update({n: fh.get_tensor(n) for n in fh.keys()})  # noqa: SIM118
    experts = model.model.layers[2].mlp.experts  # transformers' module, both families
    gate = tensors[f"model.layers.2.{prefix}.experts.5.{gate_name}.weight"]
    down = tensors[f"model.layers.2.{prefix}.experts.5.{down_name}.weight"]
    assert torch.equal(experts.gate_up_proj[5, : gate.shape[0]], gate)
    assert torch.equal(experts.down_proj[5], down)
    assert len(files) == 2


def test_qwen3_moe_dense_layers_and_outputs_vary(tmp_path: Path) -> None:
    path = make_moe_checkpoint("qwen3_moe", tmp_path, num_layers=4, decoder_sparse_step=2)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert sparse == [False, True, False, True]
    outs = {tuple(hf_greedy(model, [5 + i, 17, 33], 6)) for i in range(4)}
    assert len(outs) == 4
