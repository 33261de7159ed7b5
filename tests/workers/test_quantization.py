"""Reading a quantized checkpoint's quantization_config and the `quantization` setting
(workers/quantization.py): FP8 block-scaled accepted, every other scheme refused with the
field and its value named, tensor-parallel degrees that cut a scale block refused before any
worker starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.fp8_checkpoints import make_fp8_checkpoint
from workers.config import EngineArgs, ModelConfig
from workers.quantization import QuantizationConfig

FP8 = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head"],
}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_checkpoint("qwen3", tmp_path_factory.mktemp("fp8") / "qwen3")


def test_fp8_checkpoint_is_detected(fp8_dir: Path) -> None:
    c = ModelConfig.from_pretrained(fp8_dir)
    assert c.quantization == QuantizationConfig(method="fp8", modules_to_not_convert=("lm_head",))
    assert c.quantization.describe() == "fp8 (128x128 block-scaled weights, dynamic activations)"
    config = EngineArgs(model=str(fp8_dir), quantization="fp8").create_config()
    assert config.model.quantization == c.quantization


def test_transformers_defaults_for_absent_keys() -> None:
    """activation_scheme and fmt default to transformers' ("dynamic", e4m3)."""
    raw = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert QuantizationConfig.from_hf("Qwen3ForCausalLM", raw, "auto") == QuantizationConfig("fp8")


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        # GPTQ and AWQ int4 are served; their other variants: tests/workers/test_gptq_awq.py.
        ({"quant_method": "gptq", "bits": 3}, "quantization_config.bits 3 for quant_method 'gptq'"),
        ({"quant_method": "awq"}, "quantization_config.w_bit None for quant_method 'awq'"),
        ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method 'bitsandbytes'"),
        # Its formats: tests/workers/test_compressed_tensors.py.
        ({"quant_method": "compressed-tensors"}, "quantization_config.format None"),
        ({"quant_method": "mystery"}, "quantization_config.quant_method 'mystery'"),
        ({"quant_method": None}, "quantization_config.quant_method None"),
        ({"weight_block_size": [64, 64]}, "quantization_config.weight_block_size [64, 64]"),
        ({"weight_block_size": None}, "quantization_config.weight_block_size None"),
        ({"activation_scheme": "static"}, "quantization_config.activation_scheme 'static'"),
        ({"fmt": "e5m2"}, "quantization_config.fmt 'e5m2'"),
    ],
)
def test_unsupported_schemes_are_refused_naming_field_and_value(changes: dict, named: str) -> None:
    raw = {k: v for k, v in {**FP8, **changes}.items() if v is not None}
    with pytest.raises(ValueError, match="unsupported " + _re(named)):
        QuantizationConfig.from_hf("Qwen3ForCausalLM", raw, "auto")


def test_an_unsupported_scheme_is_refused_by_engine_args(fp8_dir: Path, tmp_path: Path) -> None:
    """From config.json through EngineArgs: the error a user sees, before any weight is read."""
    path = tmp_path / "gptq"
    path.mkdir()
    for f in fp8_dir.iterdir():
        (path / f.name).symlink_to(f)
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": 128}
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bits 8 for quant_method 'gptq'"):
        EngineArgs(model=str(path)).create_config()


def test_quantization_none_refuses_a_quantized_checkpoint(fp8_dir: Path) -> None:
    with pytest.raises(ValueError, match="quant_method 'fp8'.*quantization is 'none'"):
        EngineArgs(model=str(fp8_dir), quantization="none").create_config()


def test_quantization_fp8_refuses_a_full_precision_checkpoint(tmp_path: Path) -> None:
    path = make_checkpoint("qwen3", tmp_path / "qwen3")
    for setting in ("auto", "none"):
        assert (
            EngineArgs(model=str(path), quantization=setting).create_config().model.quantization
            is None
        )
    with pytest.raises(ValueError, match="quantization 'fp8' needs an FP8 checkpoint"):
        EngineArgs(model=str(path), quantization="fp8").create_config()


def test_an_unknown_quantization_setting_is_refused(fp8_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of .* got 'int4'"):
        EngineArgs(model=str(fp8_dir), quantization="int4").create_config()


def test_gemma_fp8_is_refused() -> None:
    with pytest.raises(ValueError, match="FP8 checkpoints of Gemma3ForCausalLM"):
        QuantizationConfig.from_hf("Gemma3ForCausalLM", FP8, "auto")


def test_tensor_parallel_degrees_that_cut_a_block_are_refused(fp8_dir: Path) -> None:
    c = ModelConfig.from_pretrained(fp8_dir)  # heads 4 x 128, KV heads 2 x 128, MLP 512
    c.check_tensor_parallel(2)
    c.check_tensor_parallel(4)  # q 128 per rank, the KV heads replicated, MLP 128 per rank
    odd = dataclasses.replace(c, intermediate_size=384)
    odd.check_tensor_parallel(1)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(2\) splits intermediate_size \(384\) into"
    ):
        odd.check_tensor_parallel(2)
    half_heads = dataclasses.replace(c, head_dim=64, num_heads=8, num_kv_heads=4)
    with pytest.raises(
        ValueError, match=r"num_attention_heads \* head_dim \(512\) into shards of 64"
    ):
        half_heads.check_tensor_parallel(8)
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \* head_dim \(256\) into shards of 64"
    ):
        half_heads.check_tensor_parallel(4)
    # Full precision: the same degrees are fine.
    dataclasses.replace(odd, quantization=None).check_tensor_parallel(2)


def test_experts_tensor_parallel_refusal_and_expert_parallel(tmp_path: Path) -> None:
    path = make_fp8_checkpoint("qwen3_moe", tmp_path / "moe", moe_intermediate_size=256)
    c = ModelConfig.from_pretrained(path)
    c.check_tensor_parallel(2)
    with pytest.raises(
        ValueError, match=r"the experts' intermediate size \(256\) into shards of 64"
    ):
        c.check_tensor_parallel(4)
    ep = dataclasses.replace(c, moe=dataclasses.replace(c.moe, expert_parallel=True))
    ep.check_tensor_parallel(4)  # whole experts per rank: nothing is cut
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(model=str(path), tensor_parallel_size=4).create_config()


def _re(text: str) -> str:
    import re

    return re.escape(text)
