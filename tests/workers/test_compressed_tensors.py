"""Reading a compressed-tensors checkpoint's quantization_config (workers/compressed_tensors.py):
float-quantized FP8 weights per channel, per tensor or per 128x128 block, weight-only or with
dynamic per-token activations, accepted; everything else refused with the field and its value
named, before any weight is read."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.compressed_tensors_checkpoints import quantization_config
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
        ("format", "pack-quantized", "format 'pack-quantized'"),
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
