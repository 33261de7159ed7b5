"""GPTQ and AWQ int4 checkpoints (workers/gptq_awq.py, workers/device/gptq_awq_targets.py).

No official reference installs here (transformers reads both only through `gptqmodel`, which
needs torch >= 2.14 and builds from source; AutoAWQ is archived and needs triton), so the
checkpoints are packed by tests/gptq_awq_checkpoints.py from the formats' published
descriptions, and the oracle is transformers on each one's full-precision twin: the same
model with every projection replaced by exactly the float32 weights the int4 file encodes.
Checked: the engine's greedy tokens and logprobs equal transformers' on the twin (float32);
the dequantized weights kvray holds equal the twin's, bit for bit, on every tensor-parallel
rank (its slice), and lie within half a quantization step of the weights quantized; the
configs read and the variants refused with the field named."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.gptq_awq_checkpoints import make_int4_checkpoint
from tests.workers.parity import assert_greedy_and_logprobs_match
from workers import LLM, SamplingParams
from workers.config import ModelConfig
from workers.device.distributed import TPGroup
from workers.device.loader import load_weights
from workers.device.models import build_model
from workers.quantization import QuantizationConfig

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
# name -> (kind, make_int4_checkpoint's keywords)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq": ("gptq", {}),
    "gptq-desc-act": ("gptq", {"desc_act": True}),
    "gptq-asym-g64": ("gptq", {"sym": False, "group": 64}),
    "gptq-v2-channel": ("gptq", {"group": None, "sym": False, "v1": False}),
    "gptq-desc-act-asym-g32": ("gptq", {"desc_act": True, "sym": False, "group": 32}),
    "awq": ("awq", {}),
    "awq-g32": ("awq", {"group": 32}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gptq-awq")
    return {v: make_int4_checkpoint(kind, root / v, **kw) for v, (kind, kw) in VARIANTS.items()}


def _twin(path: Path) -> Path:
    return path.with_name(path.name + "-twin")


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 3800) for _ in range(n)] for n in (1, 5, 17, 40)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_logprobs_match_transformers_on_the_twin(
    variant: str, checkpoints: dict[str, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    path = checkpoints[variant]
    prompts = _prompts()
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    try:
        quant = llm.engine.config.model.quantization
        assert quant is not None and (quant.method, quant.weights) == (
            variant.split("-")[0],
            "int4",
        )
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        proj = llm.engine.executor.worker.model.layers[0].mlp.down_proj
        assert proj.weight_packed.numel() * 8 == proj.in_features * sum(proj.output_sizes)
    finally:
        llm.engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(_twin(path)), dtype=torch.float32).eval()
    assert_greedy_and_logprobs_match(hf, prompts, outs, MAX_TOKENS)


def _loaded(path: Path, tp: TPGroup) -> torch.nn.Module:
    c = ModelConfig.from_pretrained(path)
    model = build_model(c, tp, torch.float32, 64)
    load_weights(model, c, tp)
    return model


@pytest.mark.parametrize("variant", ["gptq-desc-act-asym-g32", "awq", "gptq-v2-channel"])
def test_each_rank_holds_exactly_its_slice_of_the_encoded_weights(
    variant: str, checkpoints: dict[str, Path]
) -> None:
    path = checkpoints[variant]
    twin = load_file(str(_twin(path) / "model.safetensors"))
    original = load_file(str(path.with_name(path.name + "-base") / "model.safetensors"))
    p = "model.layers.1."
    for name in ("self_attn.k_proj", "mlp.down_proj"):  # quantization error: half a step
        w, dense = original[p + name + ".weight"], twin[p + name + ".weight"]
        step = load_file(str(path / "model.safetensors"))[p + name + ".scales"].float().amax()
        assert (dense - w).abs().max() <= step / 2 + 1e-6
    q, k, v = (twin[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    gate, up = (twin[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up"))
    o, down = twin[p + "self_attn.o_proj.weight"], twin[p + "mlp.down_proj.weight"]
    for rank in range(2):
        layer = _loaded(path, TPGroup(rank=rank, size=2)).layers[1]
        want = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
        assert torch.equal(layer.self_attn.qkv_proj.dequantized(torch.float32), want)
        assert torch.equal(layer.self_attn.o_proj.dequantized(torch.float32), o.chunk(2, 1)[rank])
        want = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
        assert torch.equal(layer.mlp.gate_up_proj.dequantized(torch.float32), want)
        assert torch.equal(layer.mlp.down_proj.dequantized(torch.float32), down.chunk(2, 1)[rank])


def _read(raw: dict[str, Any], arch: str = "Qwen3ForCausalLM") -> QuantizationConfig:
    quant = QuantizationConfig.from_hf(arch, raw, "auto")
    assert quant is not None
    return quant


def test_configs_are_read() -> None:
    gptq = _read({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
                  "sym": True, "checkpoint_format": "gptq"})  # fmt: skip
    assert (gptq.layout, gptq.strategy, gptq.col_block, gptq.act_order, gptq.zero_point) == (
        "gptq", "group", 128, True, False,
    )  # fmt: skip
    assert gptq.describe() == (
        "gptq (W4A16: int4 weights scaled per group of 128 columns, activation order, "
        "unquantized activations)"
    )
    channel = _read({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True})
    assert (channel.strategy, channel.act_order, channel.layout) == ("channel", False, "gptq")
    v2 = _read({"quant_method": "gptq", "bits": 4, "group_size": 32, "format": "gptq_v2"})
    assert v2.layout == "gptq_v2"
    # AutoAWQ's own key names (w_bit, q_group_size) and transformers' (bits, group_size).
    for raw in (
        {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True,
         "version": "GEMM"},
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    ):  # fmt: skip
        awq = _read(raw)
        assert (awq.layout, awq.col_block, awq.zero_point) == ("awq", 128, True)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({**GPTQ, "bits": 8}, "bits 8 for quant_method 'gptq'"),
        ({**GPTQ, "group_size": 0}, "group_size 0 for quant_method 'gptq'"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({**GPTQ, "desc_act": "yes"}, "desc_act 'yes'"),
        ({**GPTQ, "lm_head": True}, "lm_head True"),
        ({**AWQ, "bits": 3}, "bits 3 for quant_method 'awq'"),
        ({**AWQ, "version": "gemv"}, "version 'gemv'"),
        ({**AWQ, "version": "exllama"}, "version 'exllama'"),
        ({**AWQ, "zero_point": False}, "zero_point False"),
        ({**AWQ, "group_size": -1}, "group_size -1 for quant_method 'awq'"),
    ],
)
def test_other_variants_are_refused_naming_field_and_value(raw: dict, named: str) -> None:
    with pytest.raises(ValueError, match=r"^unsupported quantization_config\." + _re(named)):
        _read(raw)


def test_moe_models_and_quantization_fp8_are_refused() -> None:
    with pytest.raises(ValueError, match="GPTQ checkpoints of Qwen3MoeForCausalLM"):
        _read(GPTQ, arch="Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match="AWQ checkpoints of MixtralForCausalLM"):
        _read(AWQ, arch="MixtralForCausalLM")
    with pytest.raises(ValueError, match="this awq checkpoint's weights are int4"):
        QuantizationConfig.from_hf("Qwen3ForCausalLM", AWQ, "fp8")


def _re(text: str) -> str:
    import re

    return re.escape(text)


def _with_biases(src: Path, dst: Path, value: float) -> Path:
    """A copy of `src` with a `bias` of `value` on every projection, as AutoGPTQ saves them."""
    from safetensors.torch import save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".scales")]:
        tensors[name.removesuffix("scales") + "bias"] = torch.full(
            (tensors[name].shape[1],), value, dtype=torch.float16
        )
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_zero_biases_on_every_projection_are_read_and_others_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints["gptq"]
    zeros = _loaded(_with_biases(src, tmp_path / "zeros", 0.0), TPGroup())
    plain = _loaded(src, TPGroup())
    layer, want = zeros.layers[0].mlp.down_proj, plain.layers[0].mlp.down_proj
    assert torch.equal(layer.dequantized(torch.float32), want.dequantized(torch.float32))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.\d\.\S+_proj\.bias: a bias on a projection this model has none",
    ):
        _loaded(_with_biases(src, tmp_path / "ones", 1.0), TPGroup())


@pytest.mark.parametrize(
    ("variant", "fast"), [("gptq", True), ("awq", True), ("gptq-desc-act", False)]
)
def test_the_cpu_fast_path_runs_them_in_bfloat16(
    variant: str, fast: bool, checkpoints: dict[str, Path]
) -> None:
    """CPU's 4-bit GEMM (workers/device/layers/int4_linear.py) takes GPTQ and AWQ weights as
    it takes compressed-tensors' (not under activation order), within bfloat16 rounding."""
    c = ModelConfig.from_pretrained(checkpoints[variant])
    model = build_model(c, TPGroup(), torch.bfloat16, 64)
    load_weights(model, c, TPGroup())
    layer = model.layers[0].mlp.down_proj
    layer.fast_path = True
    assert layer.uses_fast_path(torch.bfloat16, 1) == fast
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    got = layer(x.bfloat16()).float()
    exact = x @ layer.dequantized(torch.float32).t()
    assert (got - exact).abs().max() <= 1e-2 * exact.abs().max()
