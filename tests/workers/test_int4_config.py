"""Reading an int4 W4A16 checkpoint's quantization_config (compressed-tensors' pack-quantized
format, workers/compressed_tensors.py): 4-bit int weights per group or per channel, symmetric
or with zero points, no input activations, accepted (the compressed-tensors package's own
configs for its W4A16 and W4A16_ASYM presets among them); everything else refused with the
field and its value named; tensor-parallel degrees that would cut a group or a packed word
refused before any worker starts."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

from tests.int4_checkpoints import w4a16_quantization_config, w4a16_scheme
from workers.quantization import QuantizationConfig

ARCH = "Qwen3ForCausalLM"
W = "config_groups.group_0.weights"


def _read(raw: dict[str, Any], arch: str = ARCH, requested: str = "auto") -> QuantizationConfig:
    quant = QuantizationConfig.from_hf(arch, raw, requested)
    assert quant is not None
    return quant


def _config(strategy: str = "group", symmetric: bool = True, group: int = 128) -> dict:
    return w4a16_quantization_config(w4a16_scheme(strategy, symmetric, group))


@pytest.mark.parametrize(("preset", "zero_point"), [("W4A16", False), ("W4A16_ASYM", True)])
def test_the_packages_own_w4a16_presets_are_read(preset: str, zero_point: bool) -> None:
    from compressed_tensors.quantization import QuantizationConfig as CTConfig
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    ct = CTConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"])
    quant = _read(json.loads(json.dumps(ct.to_dict(), default=str)))
    assert (quant.weights, quant.strategy, quant.col_block, quant.row_block) == (
        "int4",
        "group",
        128,
        1,
    )
    assert (quant.zero_point, quant.layout, quant.scale_name) == (
        zero_point,
        "compressed-tensors",
        "weight_scale",
    )


@pytest.mark.parametrize("order", ["weight", "static"])
def test_a_calibration_only_activation_order_is_read(order: str) -> None:
    """llm-compressor's GPTQ default: the stored format is unchanged (no weight_g_idx)."""
    assert _read(_edited(f"{W}.actorder", order)).weights == "int4"


def test_channel_scales_and_the_start_up_log() -> None:
    quant = _read(_config("channel"))
    assert (quant.strategy, quant.col_block) == ("channel", None)
    assert quant.describe() == (
        "compressed-tensors (W4A16: int4 weights scaled per channel, unquantized activations)"
    )
    assert _read(_config("group", symmetric=False, group=32)).describe() == (
        "compressed-tensors (W4A16: int4 weights scaled per group of 32 columns with zero "
        "points, unquantized activations)"
    )


def _edited(path: str, value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(_config())
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    node[last] = value
    return raw


ACTS = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (f"{W}.num_bits", 8, r"config_groups.\*.weights.num_bits 8 .*4-bit weights"),
        (f"{W}.num_bits", 2, r"config_groups.\*.weights.num_bits 2"),
        (f"{W}.type", "float", r"config_groups.\*.weights.type 'float'"),
        (f"{W}.strategy", "tensor", r"weights.strategy 'tensor'"),
        (f"{W}.group_size", None, r"weights.group_size None"),
        (f"{W}.group_size", -1, r"weights.group_size -1"),
        (f"{W}.actorder", "group", r"config_groups.\*.weights.actorder 'group'"),
        (f"{W}.symmetric", "yes", r"config_groups.\*.weights.symmetric 'yes'"),
        (f"{W}.dynamic", True, r"config_groups.\*.weights.dynamic True"),
        (
            "config_groups.group_0.input_activations",
            ACTS,
            r"config_groups.\*.input_activations \{.*weight-only int4 \(W4A16\)",
        ),
    ],
)
def test_other_int4_schemes_are_refused_naming_field_and_value(
    path: str, value: Any, named: str
) -> None:
    with pytest.raises(ValueError, match=r"^unsupported quantization_config\." + named):
        _read(_edited(path, value))


def test_quantization_fp8_and_none_refuse_it() -> None:
    with pytest.raises(ValueError, match="weights are int4"):
        _read(_config(), requested="fp8")
    with pytest.raises(ValueError, match="quantization is 'none'"):
        _read(_config(), requested="none")


def test_int4_mixture_of_experts_models_are_refused() -> None:
    with pytest.raises(ValueError, match="compressed-tensors checkpoints of Qwen3MoeForCausalLM"):
        _read(_config(), arch="Qwen3MoeForCausalLM")


def test_group_size_and_tensor_parallel_checks(tmp_path) -> None:
    from tests.int4_checkpoints import make_w4a16_checkpoint
    from workers.config import ModelConfig

    # hidden 256, q 4 x 128 = 512, kv 2 x 128, MLP 512.
    c = ModelConfig.from_pretrained(make_w4a16_checkpoint("group", tmp_path / "g"))
    assert c.quantization.weights == "int4"
    c.check_tensor_parallel(4)  # o_proj and down_proj inputs 128 per rank: whole groups
    odd = dataclasses.replace(
        c, quantization=dataclasses.replace(c.quantization, weight_block_size=(1, 96))
    )
    with pytest.raises(
        ValueError,
        match=r"^unsupported quantization_config.config_groups.\*.weights.group_size 96 .*"
        r"hidden_size is 256",
    ):
        odd.check_tensor_parallel(1)
    wide = dataclasses.replace(
        c, quantization=dataclasses.replace(c.quantization, weight_block_size=(1, 256))
    )
    with pytest.raises(
        ValueError,
        match=r"^int4 checkpoint: tensor_parallel_size \(4\) splits num_attention_heads \* "
        r"head_dim \(512\) into shards of 128, which cut its weight scale groups of 256",
    ):
        wide.check_tensor_parallel(4)
    # Per channel nothing is grouped, but the packed words still must not be cut.
    channel = dataclasses.replace(
        c,
        intermediate_size=520,
        quantization=dataclasses.replace(c.quantization, strategy="channel"),
    )
    channel.check_tensor_parallel(1)
    with pytest.raises(
        ValueError,
        match=r"^int4 checkpoint: intermediate_size \(520\) gives each of "
        r"tensor_parallel_size \(2\) ranks 260 weights, not a whole number of int32 words",
    ):
        channel.check_tensor_parallel(2)
