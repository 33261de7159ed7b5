"""Quantized checkpoints: config.json's `quantization_config` read into a frozen config, with
the engine's `quantization` setting (--quantization) applied to it.

Supported now: FP8 with 128x128 block scales, the layout of Qwen3-*-FP8 and DeepSeek-V3
(transformers' FineGrainedFP8): every attention and MLP projection (MoE experts included)
stored as float8_e4m3fn with a float32 `<name>.weight_scale_inv` of one scale per 128x128
block, activations unquantized ("dynamic"); and compressed-tensors' float-quantized FP8
(workers/compressed_tensors.py: scales per channel, per tensor or per block). The weights stay
FP8 in memory and are dequantized in each forward (workers/device/layers/fp8_linear.py).
Also compressed-tensors' int-quantized W8A16: int8 weights with a scale per output channel or
per group of input columns, activations unquantized, kept int8 in memory
(workers/device/layers/int8_linear.py); and int4 W4A16 weights, kept packed eight to an int32
in memory with a scale (and, asymmetric, a zero point) per output channel or group
(workers/device/layers/int4_linear.py): compressed-tensors' pack-quantized format, GPTQ
(`quant_method: "gptq"`, v1 packing, desc_act or not) and AWQ GEMM (`quant_method: "awq"`),
the last two read by workers/gptq_awq.py. GGUF files (quant_method "gguf", written by
workers/gguf/config.py): Q8_0 projections as int8 W8A16, Q4_0 / Q4_K ones as int4 W4A16 (Q4_K
with a float offset per group, `offset`).

`quantization`: "auto" serves what config.json says; "fp8" asks for FP8 and refuses any other
checkpoint (an int8 or int4 one too); "none" refuses a quantized checkpoint (nothing is
dequantized to full precision behind the user's back). Every other scheme (bitsandbytes,
other compressed-tensors formats and bit widths, GPTQ's v2 format or other bit widths, AWQ's
GEMV layout, an unknown method, another block size, static activation scales) is refused with
the field and its value named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.config import ModelConfig

QUANTIZATION_CHOICES = ("auto", "none", "fp8")
FP8_BLOCK = 128  # rows and columns of one FP8 scale block
# Gemma 3's modules would take FP8 linears too, but no test holds them to transformers yet.
_UNSUPPORTED_ARCHITECTURES = ("Gemma3ForCausalLM",)


@dataclass(frozen=True)
class QuantizationConfig:
    # "fp8": transformers' FineGrainedFP8 layout; "compressed-tensors": its float-quantized
    # FP8 format or its int-quantized int8 one (workers/compressed_tensors.py). FP8:
    # float8_e4m3fn weights, `w = fp8 * scale`, dequantized in each forward
    # (workers/device/layers/fp8_linear.py); int8: `w = int8 * scale`
    # (workers/device/layers/int8_linear.py).
    method: str
    weight_block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    activation_scheme: str = "dynamic"  # activations stay in the compute dtype
    # Modules the checkpoint keeps in full precision (informational: kvray reads the LM
    # head, embeddings, norms and MoE routers in full precision anyway, and refuses at load
    # a projection stored unquantized).
    modules_to_not_convert: tuple[str, ...] = ()
    # What one weight scale covers: "block" (weight_block_size), "channel" (an output row),
    # "tensor" (a whole projection, each part of a fused one its own), "group" (weight_block_size
    # [1, group_size]: weight_block_size[1] input columns of an output row; int8 only).
    strategy: str = "block"
    scale_name: str = "weight_scale_inv"  # the checkpoint's name of a weight's scales
    weights: str = "fp8"  # the stored weights: "fp8" | "int8" (W8A16) | "int4" (W4A16)
    # int4 only (workers/device/layers/int4_linear.py): whether each scale has a zero point
    # (asymmetric weights; symmetric ones are centred on 8), and the checkpoint's tensor
    # layout: "compressed-tensors" (weight_packed, ...), "gptq" or "awq" (qweight, qzeros,
    # scales; workers/gptq_awq.py); `act_order`: GPTQ's desc_act, a g_idx maps each input
    # column to its group.
    zero_point: bool = False
    layout: str = "compressed-tensors"
    act_order: bool = False
    # int4 only: a float32 offset per row and group added to the weight (`weight_offset`,
    # w = (q - zero) * scale + offset, zeros 0): GGUF's Q4_K, whose -dmin * min a uint8 zero
    # point cannot hold exactly (workers/gguf/int4.py).
    offset: bool = False

    @property
    def row_block(self) -> int | None:
        """Weight rows per scale (None: every row of the projection)."""
        return {"block": self.weight_block_size[0], "channel": 1, "group": 1}.get(self.strategy)

    @property
    def col_block(self) -> int | None:
        """Weight columns per scale (None: every column)."""
        return self.weight_block_size[1] if self.strategy in ("block", "group") else None

    @property
    def group_field(self) -> str:
        """config.json's name for the group size, for messages."""
        if self.method == "compressed-tensors":
            return "config_groups.*.weights.group_size"
        return "group_size"

    def describe(self) -> str:
        """For the start-up log and /v1/models: "fp8 (128x128 block-scaled weights, dynamic
        activations)"; "compressed-tensors (W8A16: int8 weights scaled per channel,
        unquantized activations)"."""
        if self.weights in ("int8", "int4"):
            per = "channel" if self.strategy == "channel" else f"group of {self.col_block} columns"
            bits = self.weights.removeprefix("int")
            zeros = " with zero points" if self.zero_point else ""
            zeros = " with float offsets" if self.offset else zeros
            order = ", activation order" if self.act_order else ""
            return (
                f"{self.method} (W{bits}A16: {self.weights} weights scaled per {per}{zeros}"
                f"{order}, unquantized activations)"
            )
        acts = self.activation_scheme
        if self.strategy == "block":
            rows, cols = self.weight_block_size
            scales = f"{rows}x{cols} block-scaled weights"
        else:
            scales = f"per-{self.strategy} scaled FP8 weights"
        if acts == "dynamic-token":
            acts = "per-token dynamic activation scales (computed unquantized)"
        else:
            acts = f"{acts} activations"
        return f"{self.method} ({scales}, {acts})"

    def check_tensor_parallel(self, model: ModelConfig, tp_size: int) -> None:
        """Raises ValueError when a tensor-parallel shard would cut a scale block: a rank's
        slice of a split dimension must be a whole number of blocks."""
        if self.strategy == "group":
            self._check_groups(model, tp_size)
        if self.weights == "int4":
            self._check_packing(model, tp_size)
        if tp_size == 1 or self.strategy != "block":
            return
        block = self.weight_block_size[0]
        q = model.num_heads * model.head_dim
        kv_per = model.kv_heads_per_rank(tp_size) * model.head_dim
        split = {
            "num_attention_heads * head_dim": (q, q // tp_size),
            "num_key_value_heads * head_dim": (model.num_kv_heads * model.head_dim, kv_per),
        }
        moe = model.moe
        if moe is None or len(moe.sparse_layers) < model.num_layers:  # some dense MLPs
            split["intermediate_size"] = (
                model.intermediate_size,
                model.intermediate_size // tp_size,
            )
        if moe is not None and not moe.expert_parallel:
            split["the experts' intermediate size"] = (
                moe.intermediate_size,
                moe.intermediate_size // tp_size,
            )
        for what, (total, per) in split.items():
            if per % block:
                raise ValueError(
                    f"FP8 checkpoint: tensor_parallel_size ({tp_size}) splits {what} ({total}) "
                    f"into shards of {per}, which cut its {block}x{block} scale blocks; pick a "
                    f"tensor_parallel_size that leaves each shard a multiple of {block}"
                )

    def _check_groups(self, model: ModelConfig, tp_size: int) -> None:
        """A group of input columns must divide each projection's input, and each rank's part
        of a row-parallel projection's (o_proj, down_proj) input: no group is cut."""
        group = self.col_block
        assert group is not None
        q = model.num_heads * model.head_dim
        inputs = {"hidden_size": model.hidden_size, "num_attention_heads * head_dim": q}
        if model.moe is None:
            inputs["intermediate_size"] = model.intermediate_size
        for what, size in inputs.items():
            if size % group:
                raise ValueError(
                    f"unsupported quantization_config.{self.group_field} {group} for "
                    f"quant_method {self.method!r}: it must divide each projection's input "
                    f"size, and {what} is {size}"
                )
        if self.act_order:  # g_idx: a rank holds every group's scales, none is cut
            return
        for what, size in list(inputs.items())[1:]:  # the row-parallel projections' inputs
            if (size // tp_size) % group:
                raise ValueError(
                    f"{self.weights} checkpoint: tensor_parallel_size ({tp_size}) splits {what} "
                    f"({size}) into shards of {size // tp_size}, which cut its weight scale "
                    f"groups of {group} columns (quantization_config.{self.group_field}); pick "
                    f"a tensor_parallel_size that leaves each shard a multiple of {group}"
                )

    def _check_packing(self, model: ModelConfig, tp_size: int) -> None:
        """int4 weights (and zero points) are packed eight to an int32 along the input or the
        output: each rank's part of every split dimension must be whole words."""
        q = model.num_heads * model.head_dim
        dims = {
            "num_attention_heads * head_dim": (q, q // tp_size),
            "num_key_value_heads * head_dim": (
                model.num_kv_heads * model.head_dim,
                model.kv_heads_per_rank(tp_size) * model.head_dim,
            ),
            "intermediate_size": (model.intermediate_size, model.intermediate_size // tp_size),
            "hidden_size": (model.hidden_size, model.hidden_size),
        }
        for what, (size, per) in dims.items():
            if per % 8:
                raise ValueError(
                    f"int4 checkpoint: {what} ({size}) gives each of tensor_parallel_size "
                    f"({tp_size}) ranks {per} weights, not a whole number of int32 words of "
                    f"eight 4-bit values; pick a tensor_parallel_size that leaves a multiple of 8"
                )

    @staticmethod
    def from_hf(arch: str, raw: dict[str, Any] | None, requested: str) -> QuantizationConfig | None:
        """`raw`: config.json's quantization_config (None: a full-precision checkpoint);
        `requested`: the engine's `quantization` setting. None: full precision."""
        if requested not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_CHOICES}, got {requested!r}"
            )
        if raw is None:
            if requested == "fp8":
                raise ValueError(
                    "quantization 'fp8' needs an FP8 checkpoint, and config.json has no "
                    "quantization_config (quantizing full-precision weights at load is not "
                    "supported yet)"
                )
            return None
        method = raw.get("quant_method")
        if requested == "none":
            raise ValueError(
                f"the checkpoint is quantized (quantization_config.quant_method {method!r}) "
                "and quantization is 'none'; use 'auto' to serve it"
            )
        if method == "gguf":  # written from a GGUF file's tensor types (workers/gguf/config.py)
            from workers.gguf.config import gguf_quantization_fields

            fields = gguf_quantization_fields(raw, requested)
            return None if fields is None else QuantizationConfig(**fields)
        if method in ("compressed-tensors", "gptq", "awq"):
            from workers.compressed_tensors import compressed_tensors_fields
            from workers.gptq_awq import awq_fields, gptq_fields

            read = {"gptq": gptq_fields, "awq": awq_fields}.get(method, compressed_tensors_fields)
            quant = QuantizationConfig(**read(arch, raw))
            if requested == "fp8" and quant.weights != "fp8":
                raise ValueError(
                    f"quantization 'fp8' needs an FP8 checkpoint, and this {method} "
                    f"checkpoint's weights are {quant.weights}; use 'auto' to serve it"
                )
            return quant
        if method != "fp8":
            raise ValueError(
                f"unsupported quantization_config.quant_method {method!r}: kvray supports "
                "'fp8' (128x128 block-scaled), 'compressed-tensors' (float-quantized FP8, "
                "int-quantized int8 W8A16, pack-quantized int4 W4A16), 'gptq' and 'awq' (int4) "
                "checkpoints"
            )
        _need(raw, "weight_block_size", [FP8_BLOCK, FP8_BLOCK], "only [128, 128] block scales")
        _need(raw, "activation_scheme", "dynamic", "only dynamic activations", absent="dynamic")
        _need(raw, "fmt", "e4m3", "only float8_e4m3fn weights", absent="e4m3")
        if arch in _UNSUPPORTED_ARCHITECTURES:
            raise ValueError(f"FP8 checkpoints of {arch} are not supported yet")
        skip = [*(raw.get("modules_to_not_convert") or ()), *(raw.get("ignored_layers") or ())]
        return QuantizationConfig(method="fp8", modules_to_not_convert=tuple(map(str, skip)))


def _need(raw: dict[str, Any], key: str, want: Any, supported: str, absent: Any = None) -> None:
    value = raw.get(key, absent)
    if isinstance(value, tuple):
        value = list(value)
    if value != want:
        raise ValueError(
            f"unsupported quantization_config.{key} {value!r} for quant_method 'fp8': "
            f"{supported} ({want!r})"
        )


def describe(quant: QuantizationConfig | None) -> str:
    """The quantization in use, for logs: "none" when the weights are full precision."""
    return "none" if quant is None else quant.describe()


def check_quantized_tensor_parallel(model: ModelConfig, tp_size: int) -> None:
    """`QuantizationConfig.check_tensor_parallel` of `model`'s quantization, if it has one."""
    if model.quantization is not None:
        model.quantization.check_tensor_parallel(model, tp_size)
