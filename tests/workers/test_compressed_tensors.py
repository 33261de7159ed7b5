"""Reading a compressed-tensors checkpoint's quantization_config (workers/compressed_tensors.py):
float-quantized FP8 weights per channel, per tensor or per 128x128 block, weight-only or with
dynamic per-token activations, and int-quantized int8 weights (W8A16) per channel or per group,
accepted; everything else refused with the field and its value named, before any weight is
read."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

from tests.compressed_tensors_checkpoints import int8_quantization_config, quantization_config
from workers.quantization import QuantizationConfig

ARCH = "Qwen3ForCausalLM"


def _read(raw: dict[str, Any], arch: str = ARCH, requested: str = "auto") -> QuantizationConfig:
    quant = QuantizationConfig.from_hf(arch, raw, requested)
    assert quant is not None
    return quant


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_fp8_schemes_are_read(strategy: str) -> None:
    quant = _read(quantization_config(strategy))
    assert (quant.method, quant.strategy, quant.scale_name) == (
        "compressed-tensors",
        strategy,
        "weight_scale",
    )
    assert quant.activation_scheme == "dynamic-token"
    assert quant.modules_to_not_convert == ("lm_head",)
    rows, cols = {"channel": (1, None), "tensor": (None, None), "block": (128, 128)}[strategy]
    assert (quant.row_block, quant.col_block) == (rows, cols)
    weight_only = _read(quantization_config(strategy, activations=False))
    assert weight_only.activation_scheme == "dynamic"
    # --quantization fp8 takes it: FP8 weights either way.
    assert _read(quantization_config(strategy), requested="fp8") == quant


def test_its_block_is_the_fp8_layers_block() -> None:
    from workers import compressed_tensors, quantization

    assert compressed_tensors.BLOCK == quantization.FP8_BLOCK


def test_the_start_up_log_says_what_is_served() -> None:
    assert _read(quantization_config("channel")).describe() == (
        "compressed-tensors (per-channel scaled FP8 weights, per-token dynamic activation "
        "scales (computed unquantized))"
    )


def _edited(path: str, value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(quantization_config("channel"))
    node = raw
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return raw


W = "config_groups.group_0.weights"
A = "config_groups.group_0.input_activations"


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("format", "naive-quantized", "format 'naive-quantized'"),
        ("format", None, "format None"),
        (f"{W}.num_bits", 4, r"config_groups.\*.weights.num_bits 4"),
        (f"{W}.type", "int", r"config_groups.\*.weights.type 'int'"),
        (f"{W}.symmetric", False, r"config_groups.\*.weights.symmetric False"),
        (f"{W}.dynamic", True, r"config_groups.\*.weights.dynamic True"),
        (f"{W}.strategy", "group", r"weights.strategy 'group'"),
        (f"{A}.dynamic", False, r"config_groups.\*.input_activations.dynamic False"),
        (
            "config_groups.group_0.targets",
            ["Attention"],
            r"config_groups.\*.targets \['Attention'\]",
        ),
        ("config_groups", {}, r"config_groups \{\}"),
    ],
)
def test_other_schemes_are_refused_naming_field_and_value(
    path: str, value: Any, named: str
) -> None:
    with pytest.raises(ValueError, match=r"^unsupported quantization_config\." + named):
        _read(_edited(path, value))


def test_two_schemes_and_a_wrong_block_are_refused() -> None:
    raw = quantization_config("channel")
    raw["config_groups"]["group_1"] = quantization_config("tensor")["config_groups"]["group_0"]
    with pytest.raises(ValueError, match="exactly one quantization scheme"):
        _read(raw)
    raw = quantization_config("block")
    raw["config_groups"]["group_0"]["weights"]["block_structure"] = [64, 64]
    with pytest.raises(ValueError, match=r"weights.block_structure \[64, 64\]"):
        _read(raw)


def test_mixture_of_experts_models_are_refused() -> None:
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        with pytest.raises(ValueError, match=f"compressed-tensors checkpoints of {arch}"):
            _read(quantization_config("channel"), arch=arch)


# int8 weight-only (W8A16, format "int-quantized").


@pytest.mark.parametrize("strategy", ["channel", "group"])
def test_int8_w8a16_schemes_are_read(strategy: str) -> None:
    quant = _read(int8_quantization_config(strategy))
    assert (quant.method, quant.weights, quant.strategy, quant.scale_name) == (
        "compressed-tensors",
        "int8",
        strategy,
        "weight_scale",
    )
    assert quant.activation_scheme == "dynamic"  # activations unquantized
    assert (quant.row_block, quant.col_block) == (1, None if strategy == "channel" else 128)
    per = "channel" if strategy == "channel" else "group of 128 columns"
    assert quant.describe() == (
        f"compressed-tensors (W8A16: int8 weights scaled per {per}, unquantized activations)"
    )
    assert _read(int8_quantization_config("group", group=64)).col_block == 64
    with pytest.raises(ValueError, match="quantization 'fp8' needs an FP8 checkpoint.* int8"):
        _read(int8_quantization_config(strategy), requested="fp8")


def test_the_compressed_tensors_packages_own_w8a16_config_is_read() -> None:
    """The config the package itself saves for its "W8A16" preset (int-quantized)."""
    from compressed_tensors.quantization import QuantizationConfig as CTConfig
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("W8A16", ["Linear"])
    ct = CTConfig(config_groups={"group_0": scheme}, format="int-quantized", ignore=["lm_head"])
    raw = json.loads(json.dumps(ct.to_dict(), default=str))
    quant = _read(raw)
    assert (quant.weights, quant.strategy, quant.col_block) == ("int8", "group", 128)


def _int8_edited(path: str, value: Any, strategy: str = "channel") -> dict[str, Any]:
    raw = copy.deepcopy(int8_quantization_config(strategy))
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    node[last] = value
    return raw


INT8_ACTS = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}


@pytest.mark.parametrize(
    ("path", "value", "strategy", "named"),
    [
        (f"{W}.num_bits", 4, "channel", r"config_groups.\*.weights.num_bits 4"),
        (
            f"{W}.type",
            "float",
            "channel",
            r"config_groups.\*.weights.type 'float'.* int weights in format",
        ),
        (f"{W}.symmetric", False, "channel", r"config_groups.\*.weights.symmetric False"),
        (
            f"{W}.strategy",
            "tensor",
            "channel",
            r"weights.strategy 'tensor'.*\('channel', 'group'\)",
        ),
        (f"{W}.strategy", "block", "channel", r"weights.strategy 'block'"),
        (f"{W}.group_size", None, "group", r"weights.group_size None"),
        (f"{W}.group_size", 0, "group", r"weights.group_size 0"),
        (f"{W}.actorder", "group", "group", r"config_groups.\*.weights.actorder 'group'"),
        (A, INT8_ACTS, "channel", r"config_groups.\*.input_activations \{.*weight-only int8"),
        # 8-bit pack-quantized: int4 only (tests/workers/test_int4_config.py).
        (
            "format",
            "pack-quantized",
            "channel",
            r"config_groups.\*.weights.num_bits 8.* 4-bit weights in format 'pack-quantized'",
        ),
    ],
)
def test_other_int8_schemes_are_refused_naming_field_and_value(
    path: str, value: Any, strategy: str, named: str
) -> None:
    with pytest.raises(ValueError, match=r"^unsupported quantization_config\." + named):
        _read(_int8_edited(path, value, strategy))


def test_int8_mixture_of_experts_models_are_refused() -> None:
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        with pytest.raises(ValueError, match=f"compressed-tensors checkpoints of {arch}"):
            _read(int8_quantization_config("channel"), arch=arch)


def test_a_group_size_must_divide_every_input_and_each_rank_shard(tmp_path) -> None:
    from tests.compressed_tensors_checkpoints import make_int8_checkpoint
    from workers.config import ModelConfig

    # hidden 256, q 4 x 128 = 512, MLP 512.
    c = ModelConfig.from_pretrained(make_int8_checkpoint("group", tmp_path / "g"))
    c.check_tensor_parallel(1)
    c.check_tensor_parallel(4)  # o_proj and down_proj inputs 128 per rank
    odd = dataclasses.replace(
        c, quantization=dataclasses.replace(c.quantization, weight_block_size=(1, 96))
    )
    with pytest.raises(
        ValueError,
        match=r"^unsupported quantization_config.config_groups.\*.weights.group_size 96 .* "
        r"hidden_size is 256",
    ):
        odd.check_tensor_parallel(1)
    wide = dataclasses.replace(
        c, quantization=dataclasses.replace(c.quantization, weight_block_size=(1, 256))
    )
    wide.check_tensor_parallel(2)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size \(4\) splits num_attention_heads \* head_dim \(512\) into "
        r"shards of 128, which cut its weight scale groups of 256 columns",
    ):
        wide.check_tensor_parallel(4)
    # Per channel: nothing to cut.
    ch = dataclasses.replace(
        c, quantization=dataclasses.replace(c.quantization, strategy="channel")
    )
    ch.check_tensor_parallel(4)
