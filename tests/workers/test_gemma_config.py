"""Reading a Gemma 3 checkpoint's config.json (workers/gemma_config.py): the layer types and
ropes transformers builds, its defaults, the max_model_len cap from the sliding window, and
the settings refused with the field named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from tests.gemma_checkpoints import GLOBAL_THETA, LOCAL_THETA, make_gemma_checkpoint
from workers.config import SUPPORTED_ARCHITECTURES, EngineArgs, ModelConfig, RopeConfig


def _edit(path: Path, **changes: Any) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _hf_sliding(path: Path) -> tuple[int, ...]:
    types = AutoConfig.from_pretrained(str(path)).layer_types
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


@pytest.mark.parametrize(
    ("spelling", "kw"),
    [
        ("new", {}),
        ("new", {"layer_types": ("full_attention", "sliding_attention")}),
        ("old", {}),
        ("old", {"num_layers": 7, "sliding_window_pattern": 2}),
    ],
)
def test_layers_and_ropes_as_transformers(spelling: str, kw: dict, tmp_path: Path) -> None:
    path = make_gemma_checkpoint(tmp_path, spelling=spelling, **kw)
    c = ModelConfig.from_pretrained(path)
    assert c.architecture == "Gemma3ForCausalLM" and c.gemma is not None
    assert c.gemma.sliding_layers == _hf_sliding(path) != ()
    assert c.gemma.local_rope == RopeConfig(theta=LOCAL_THETA)
    assert c.rope == c.gemma.global_rope == RopeConfig(GLOBAL_THETA, "linear", factor=2.0)
    assert c.gemma.scale == 64**-0.5
    assert (c.head_dim, c.qk_norm, c.tie_word_embeddings, c.sliding_window) == (48, True, True, 256)


def test_sliding_window_pattern_default_is_transformers(tmp_path: Path) -> None:
    path = make_gemma_checkpoint(tmp_path, spelling="old", num_layers=13)
    _edit(path, sliding_window_pattern=None)
    assert ModelConfig.from_pretrained(path).gemma.sliding_layers == _hf_sliding(path)
    assert 5 not in _hf_sliding(path) and 11 not in _hf_sliding(path)


def test_absent_keys_take_transformers_defaults(tmp_path: Path) -> None:
    path = make_gemma_checkpoint(tmp_path, spelling="old")
    absent = ("tie_word_embeddings", "head_dim", "max_position_embeddings", "rope_theta")
    _edit(path, **dict.fromkeys(absent), rope_local_base_freq=None, rope_scaling=None)
    _edit(path, query_pre_attn_scalar=None, sliding_window=None, hidden_activation=None)
    c, hf = ModelConfig.from_pretrained(path), AutoConfig.from_pretrained(str(path))
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert (c.head_dim, c.max_position_embeddings) == (hf.head_dim, hf.max_position_embeddings)
    assert c.sliding_window == hf.sliding_window
    assert c.gemma.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert c.rope.theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert c.gemma.local_rope.theta == hf.rope_parameters["sliding_attention"]["rope_theta"]


def test_max_model_len_is_capped_to_the_sliding_window(tmp_path: Path) -> None:
    # No sliding-window kernel: within the window full causal attention is exact.
    path = make_gemma_checkpoint(tmp_path)
    assert EngineArgs(model=str(path), device="cpu").create_config().scheduler.max_model_len == 256
    with pytest.raises(
        ValueError, match=r"max_model_len \(300\) exceeds the model's limit \(256\)"
    ):
        EngineArgs(model=str(path), max_model_len=300, device="cpu").create_config()


def test_no_sliding_layer_means_no_cap(tmp_path: Path) -> None:
    path = make_gemma_checkpoint(tmp_path, layer_types=("full_attention",) * 2)
    c = ModelConfig.from_pretrained(path)
    assert c.sliding_window is None and c.gemma.sliding_layers == ()
    assert EngineArgs(model=str(path), device="cpu").create_config().scheduler.max_model_len == 512


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0: soft-capping"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is 30.0: soft-capping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list 4 entries"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
    ],
)
def test_refused_with_the_field_named(changes: dict, match: str, tmp_path: Path) -> None:
    path = _edit(make_gemma_checkpoint(tmp_path), **changes)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(path)


def test_soft_capping_refused_before_the_engine_starts(tmp_path: Path) -> None:
    from workers import LLM

    path = _edit(make_gemma_checkpoint(tmp_path), final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping.*no soft-cap"):
        LLM(str(path))


def test_unsupported_global_rope_type_is_named(tmp_path: Path) -> None:
    path = make_gemma_checkpoint(tmp_path, spelling="old")
    _edit(path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_pretrained(path)


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForConditionalGeneration"])
def test_other_gemma_architectures_are_refused_naming_the_supported(arch, tmp_path) -> None:
    path = _edit(make_gemma_checkpoint(tmp_path), architectures=[arch])
    assert "Gemma3ForCausalLM" in SUPPORTED_ARCHITECTURES
    with pytest.raises(
        ValueError, match=rf"unsupported architecture \['{arch}'\].*Gemma3ForCausalLM"
    ):
        ModelConfig.from_pretrained(path)
