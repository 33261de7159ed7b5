"""Reading a mixture-of-experts checkpoint's config.json (workers/moe_config.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from tests.moe_checkpoints import make_moe_checkpoint
from workers.config import SUPPORTED_ARCHITECTURES, ModelConfig
from workers.moe_config import MoeConfig


def _edit(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _hf_sparse_layers(path: Path) -> tuple[int, ...]:
    """The layers transformers builds as sparse blocks (its Qwen3MoeDecoderLayer's rule)."""
    c = AutoConfig.from_pretrained(str(path))
    return tuple(
        i
        for i in range(c.num_hidden_layers)
        if i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
    )


@pytest.mark.parametrize(
    ("layers", "dense", "step", "sparse"),
    [(4, (), 1, (0, 1, 2, 3)), (4, (0, 3), 1, (1, 2)), (5, (), 2, (1, 3)), (6, (3,), 2, (1, 5))],
)
def test_qwen3_moe_sparse_layers_as_transformers(
    layers: int, dense: tuple[int, ...], step: int, sparse: tuple[int, ...], tmp_path: Path
) -> None:
    path = make_moe_checkpoint(
        "qwen3_moe",
        tmp_path,
        num_experts=8,
        top_k=3,
        num_layers=layers,
        mlp_only_layers=dense,
        decoder_sparse_step=step,
        norm_topk_prob=False,
    )
    c = ModelConfig.from_pretrained(path)
    assert c.architecture == "Qwen3MoeForCausalLM" and c.qk_norm and c.sliding_window is None
    assert c.moe == MoeConfig(
        num_experts=8,
        top_k=3,
        intermediate_size=32,
        renormalize=False,
        weights_in_model_dtype=True,
        sparse_layers=sparse,
    )
    assert sparse == _hf_sparse_layers(path)
    assert c.intermediate_size == 96  # the dense layers'


def test_qwen3_moe_defaults_are_transformers_defaults(tmp_path: Path) -> None:
    path = make_moe_checkpoint("qwen3_moe", tmp_path)
    keys = ("num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size")
    # The expert count under either spelling (4.x's num_experts, 5.x's num_local_experts).
    _edit(path, **dict.fromkeys((*keys, "num_experts", "num_local_experts")), sliding_window=4096)
    c = ModelConfig.from_pretrained(path)
    hf = AutoConfig.from_pretrained(str(path))
    assert c.moe is not None
    assert (c.moe.num_experts, c.moe.top_k, c.moe.renormalize, c.moe.intermediate_size) == (
        hf.num_experts,
        hf.num_experts_per_tok,
        hf.norm_topk_prob,
        hf.moe_intermediate_size,
    )
    assert c.sliding_window is None  # use_sliding_window is false


def test_mixtral(tmp_path: Path) -> None:
    path = make_moe_checkpoint("mixtral", tmp_path, num_experts=8, top_k=1, num_layers=3)
    c = ModelConfig.from_pretrained(path)
    assert c.architecture == "MixtralForCausalLM" and not c.qk_norm and c.head_dim == 16
    assert c.moe is not None and c.moe.renormalize and not c.moe.weights_in_model_dtype
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == (8, 1, 48)
    assert c.moe.sparse_layers == (0, 1, 2)
    assert c.moe.block_name == "block_sparse_moe" and c.moe.expert_names == ("w1", "w3", "w2")
    _edit(path, sliding_window=64)
    assert ModelConfig.from_pretrained(path).sliding_window == 64


def test_dense_families_have_no_moe(checkpoints: dict[str, Path]) -> None:
    assert all(ModelConfig.from_pretrained(p).moe is None for p in checkpoints.values())


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    path = make_moe_checkpoint("qwen3_moe", tmp_path)
    _edit(path, architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM") as e:
        ModelConfig.from_pretrained(path)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)
    assert "Qwen3MoeForCausalLM" in SUPPORTED_ARCHITECTURES
    assert "MixtralForCausalLM" in SUPPORTED_ARCHITECTURES


def test_bad_moe_settings_are_clear_errors(tmp_path: Path) -> None:
    path = make_moe_checkpoint("mixtral", tmp_path)
    _edit(path, num_experts_per_tok=5)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be between 1 and"):
        ModelConfig.from_pretrained(path)
    _edit(path, num_experts_per_tok=2)
    c = ModelConfig.from_pretrained(path)
    c.check_tensor_parallel(2)
    odd = dataclasses.replace(c, moe=dataclasses.replace(c.moe, intermediate_size=34))
    with pytest.raises(ValueError, match=r"intermediate size \(34\) is not divisible by "):
        odd.check_tensor_parallel(4)
