"""Gemma 3's own modules (workers/device/models/gemma3.py) against transformers' in the dtypes
a user serves: the scaled embedding bit for bit, the GeGLU MLP to float rounding, and the
model built with a rope per layer type."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3TextScaledWordEmbedding

from tests.gemma_checkpoints import GLOBAL_THETA, LOCAL_THETA, make_gemma_checkpoint
from workers.config import ModelConfig
from workers.device.distributed import TPGroup
from workers.device.models import build_model
from workers.device.models.gemma3 import GeGluMLP, Gemma3ForCausalLM, ScaledEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [128, 3072])  # 3072: sqrt is 55.43, 55.5 in bfloat16
def test_scaled_embedding_equals_transformers(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    table = torch.randn(50, hidden, generator=gen).to(dtype)
    ours = ScaledEmbedding(50, hidden, TPGroup(), dtype)
    ours.weight.data.copy_(table)
    theirs = Gemma3TextScaledWordEmbedding(50, hidden, 0, embed_scale=hidden**0.5).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(table)
    ids = torch.tensor([0, 3, 49, 3])
    with torch.no_grad():
        expected = theirs(ids)
    assert torch.equal(ours(ids), expected)
    if dtype == torch.bfloat16 and hidden == 3072:
        assert ours.scale.item() == 55.5  # rounded before the product, as transformers does


def test_geglu_mlp_matches_transformers(tmp_path: Path) -> None:
    path = make_gemma_checkpoint(tmp_path)
    theirs = Gemma3MLP(AutoConfig.from_pretrained(str(path))).eval()
    ours = GeGluMLP(ModelConfig.from_pretrained(path), TPGroup(), torch.float32)
    ours.gate_up_proj.weight.data.copy_(
        torch.cat([theirs.gate_proj.weight.data, theirs.up_proj.weight.data])
    )
    ours.down_proj.weight.data.copy_(theirs.down_proj.weight.data)
    x = torch.randn(
        9, ours.gate_up_proj.weight.shape[1], generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        torch.testing.assert_close(ours(x * 3), theirs(x * 3), atol=1e-5, rtol=1e-5)


def test_each_layer_rotates_with_its_type_rope(tmp_path: Path) -> None:
    path = make_gemma_checkpoint(tmp_path)
    c = ModelConfig.from_pretrained(path)
    model = build_model(c, TPGroup(), torch.float32, 64)
    assert isinstance(model, Gemma3ForCausalLM)
    types = AutoConfig.from_pretrained(str(path)).layer_types
    local, full = model.local_rotary, model.rotary
    # cos at position 1 of the first frequency pair is cos(1) for either base; the last
    # pair's differs: cos(theta ** -(D - 2) / D), the global one also scaled by 1 / factor.
    d = c.head_dim
    assert local.cos[1, d // 2 - 1].item() == pytest.approx(
        torch.cos(torch.tensor(LOCAL_THETA ** (-(d - 2) / d))).item()
    )
    assert full.cos[1, d // 2 - 1].item() == pytest.approx(
        torch.cos(torch.tensor(GLOBAL_THETA ** (-(d - 2) / d) / 2.0)).item()
    )
    for layer, kind in zip(model.layers, types, strict=True):
        want = local if kind == "sliding_attention" else full
        assert layer.self_attn.rotary is want
        assert layer.self_attn.attn.scale == 64**-0.5  # query_pre_attn_scalar, not head_dim
