"""config.json's `quantization_config` of a compressed-tensors checkpoint (llm-compressor's
format: RedHatAI's FP8-dynamic, FP8 W8A8 and int8 W8A16 checkpoints among them), read into the
fields of a QuantizationConfig (workers/quantization.py builds it; this module imports nothing
of it).

Served:
- the "float-quantized" format, FP8 weights: every Linear of the decoder layers stored
  float8_e4m3fn with a `<name>.weight_scale` per output channel, per tensor or per 128x128
  block (`w = fp8 * scale`, as FineGrainedFP8's `weight_scale_inv`), symmetric, static; input
  activations unquantized or with dynamic per-token scales;
- the "int-quantized" format with 8-bit integer weights and no input activations (W8A16):
  every Linear stored int8 with a `<name>.weight_scale` [out, 1] per output channel, or
  [out, in / group_size] per group of input columns (`w = int8 * scale`), symmetric (no zero
  point), static;
- the "pack-quantized" format with 4-bit integer weights and no input activations (W4A16,
  llm-compressor's W4A16 and W4A16_ASYM presets, RedHatAI's *-quantized.w4a16): every Linear
  stored as `<name>.weight_packed` (int32, eight 4-bit values per word along the input,
  lowest bits first, each value stored + 8), `<name>.weight_scale` [out, 1] or
  [out, in / group_size], `<name>.weight_shape` ([out, in]) and, asymmetric, a
  `<name>.weight_zero_point` packed eight per int32 along the output rows
  (`w = (q - zero_point) * scale`; workers/device/layers/int4_linear.py).
Weights stay FP8 / int8 / int4 in memory; the activations are computed in full precision, as
transformers' reference (its loading with `dequantize=True`) computes them. Refused with the
field and its value named: another format ("naive-quantized", sparse formats), other bit
widths (8-bit "pack-quantized" too), asymmetric int8 weights, int8 activations (W8A8), a
stored activation ordering (`actorder: "group"`: a weight_g_idx permutation; "weight" /
"static", llm-compressor's GPTQ default, orders the calibration only and is served), static
activation scales, more than one scheme, and mixture-of-experts models (their expert layout
is not read yet).
"""

from __future__ import annotations

from typing import Any

# format -> (weights.type, the strategies served, what the format stores)
FORMATS = {
    "float-quantized": ("float", ("channel", "tensor", "block"), "FP8 weights"),
    "int-quantized": ("int", ("channel", "group"), "int8 weights, W8A16"),
    "pack-quantized": ("int", ("channel", "group"), "int4 weights packed in int32, W4A16"),
}
# format -> (weights.num_bits, what kvray holds: QuantizationConfig.weights, the scheme's name)
_BITS = {
    "float-quantized": (8, "fp8", "FP8"),
    "int-quantized": (8, "int8", "weight-only int8 (W8A16)"),
    "pack-quantized": (4, "int4", "weight-only int4 (W4A16)"),
}
BLOCK = 128  # the block strategy's rows and columns per scale (workers/quantization.FP8_BLOCK)
_STATIC_ORDERS = (None, "weight", "static")  # actorder values that leave the format as it is
# Expert layouts differ between llm-compressor's exports: no test holds them to a reference yet.
_UNSUPPORTED_ARCHITECTURES = ("Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


def compressed_tensors_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """QuantizationConfig's fields for the checkpoint, or ValueError naming what is not
    served."""
    fmt = raw.get("format")
    if fmt not in FORMATS:
        served = " or ".join(f"{f!r} ({what})" for f, (_, _, what) in FORMATS.items())
        _refuse("format", fmt, f"only {served}")
    wtype, strategies, _ = FORMATS[fmt]
    groups = raw.get("config_groups") or {}
    schemes = {_scheme_key(g) for g in groups.values()} if isinstance(groups, dict) else set()
    if len(schemes) != 1:
        _refuse("config_groups", groups, "exactly one quantization scheme")
    group = next(iter(groups.values()))
    targets = group.get("targets")
    if targets != ["Linear"]:
        _refuse("config_groups.*.targets", targets, "['Linear']")
    w = group.get("weights") or {}
    bits, held, scheme_name = _BITS[fmt]
    _expect("weights.num_bits", w.get("num_bits"), bits, f"{bits}-bit weights in format {fmt!r}")
    _expect("weights.type", w.get("type"), wtype, f"{wtype} weights in format {fmt!r}")
    symmetric = w.get("symmetric", True)
    if held != "int4":  # int4's asymmetric variant stores a packed zero point per scale
        _expect("weights.symmetric", symmetric, True, "symmetric weights")
    elif symmetric not in (True, False):
        _refuse("config_groups.*.weights.symmetric", symmetric, "true or false")
    _expect("weights.dynamic", w.get("dynamic", False), False, "static weight scales")
    strategy = w.get("strategy")
    if strategy not in strategies:
        _refuse("weights.strategy", strategy, f"one of {strategies} in format {fmt!r}")
    fields: dict[str, Any] = {}
    if strategy == "block":
        blocks = w.get("block_structure")
        if list(blocks or ()) != [BLOCK, BLOCK]:
            _refuse("weights.block_structure", blocks, f"[{BLOCK}, {BLOCK}]")
    if strategy == "group":
        size = w.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            _refuse("weights.group_size", size, "a positive group size")
        fields["weight_block_size"] = (1, size)
    acts = group.get("input_activations")
    scheme = "dynamic"
    if wtype == "int":
        # "weight" ("static"; llm-compressor's GPTQ default) orders the calibration only: the
        # stored format is unchanged. "group" ("dynamic") would store a weight_g_idx.
        if w.get("actorder") not in _STATIC_ORDERS:
            _refuse(
                "config_groups.*.weights.actorder",
                w.get("actorder"),
                f"no activation ordering, or one of {_STATIC_ORDERS[1:]} (format unchanged)",
            )
        _expect("input_activations", acts, None, scheme_name)
        fields["weights"] = held
        if held == "int4":
            fields["zero_point"] = not symmetric
    elif acts is not None:
        _expect("input_activations.dynamic", acts.get("dynamic"), True, "dynamic scales")
        _expect("input_activations.type", acts.get("type"), "float", "FP8 activations")
        scheme = "dynamic-token"
    if arch in _UNSUPPORTED_ARCHITECTURES:
        raise ValueError(f"compressed-tensors checkpoints of {arch} are not supported yet")
    ignore = tuple(str(x) for x in raw.get("ignore") or ())
    return {
        "method": "compressed-tensors",
        "activation_scheme": scheme,
        "modules_to_not_convert": ignore,
        "strategy": strategy,
        "scale_name": "weight_scale",
        **fields,
    }


def _scheme_key(group: Any) -> str:
    import json

    if not isinstance(group, dict):
        return repr(group)
    return json.dumps({k: group.get(k) for k in ("weights", "input_activations")}, sort_keys=True)


def _expect(field: str, value: Any, want: Any, supported: str) -> None:
    if value != want:
        _refuse(f"config_groups.*.{field}", value, f"{supported} ({want!r})")


def _refuse(field: str, value: Any, supported: str) -> None:
    raise ValueError(
        f"unsupported quantization_config.{field} {value!r} for quant_method "
        f"'compressed-tensors': kvray serves {supported}"
    )
