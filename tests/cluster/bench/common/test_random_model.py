"""Random-weight benchmark checkpoints (cluster/bench/common/random_model.py) load in both
backends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.bench.common import random_model
from workers import LLM, SamplingParams
from workers.config import ModelConfig


def test_the_moe_preset_is_qwen3_30b_a3b_scaled_down() -> None:
    hidden, layers, heads, kv, head_dim, experts, top_k, inter, _ = random_model.MOE_PRESETS[
        "qwen3-moe-tiny"
    ]
    # Half the width, half the experts with the same share active (30B-A3B: 128, top-8).
    assert (hidden, heads, kv, head_dim, inter) == (2048 // 2, 32 // 2, 4 // 2, 128, 768 // 2)
    assert (experts, top_k) == (128 // 2, 8 // 2) and layers < 48


def test_a_moe_preset_loads_in_kvray_and_transformers(tmp_path: Path, monkeypatch) -> None:
    # The preset's layout at a size a test can write: (hidden, layers, heads, kv_heads,
    # head_dim, experts, top_k, moe_intermediate, vocab).
    monkeypatch.setitem(random_model.MOE_PRESETS, "moe-test", (64, 2, 4, 2, 32, 8, 2, 32, 4096))
    path = random_model.random_model_dir("moe-test", dtype="bfloat16", cache_root=tmp_path)
    c = ModelConfig.from_pretrained(path)
    assert c.architecture == "Qwen3MoeForCausalLM" and c.moe is not None
    assert c.moe.sparse_layers == (0, 1) and c.intermediate_size == 2 * 32
    hf, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    out = LLM(str(path), kv_cache_memory_bytes=4 << 20).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_an_unknown_preset_lists_every_preset() -> None:
    with pytest.raises(ValueError, match="qwen3-0.6b, qwen3-tiny, qwen3-moe-tiny"):
        random_model.random_model_dir("nope")
