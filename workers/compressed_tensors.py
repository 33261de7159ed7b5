"""config.json's `quantization_config` of a compressed-tensors checkpoint (llm-compressor's
format: RedHatAI's FP8-dynamic and FP8 W8A8 checkpoints among them), read into the fields of a
QuantizationConfig (workers/quantization.py builds it; this module imports nothing of it).

Served: the "float-quantized" format, FP8 weights: every Linear of the decoder layers stored
float8_e4m3fn with a `<name>.weight_scale` per output channel, per tensor or per 128x128
block (`w = fp8 * scale`, as FineGrainedFP8's `weight_scale_inv`), symmetric, static; input
activations unquantized or with dynamic per-token scales. Weights stay FP8 in memory; the
activations are computed in full precision, as transformers' reference (its loading with
`dequantize=True`) computes them. Refused with the field and its value named: another format
(int4 "pack-quantized", "naive-quantized", sparse formats), integer or asymmetric weights,
static activation scales, more than one scheme, and mixture-of-experts models (their expert
layout is not read yet).
"""

from __future__ import annotations

from typing import Any

FORMAT = "float-quantized"
STRATEGIES = ("channel", "tensor", "block")
BLOCK = 128  # the block strategy's rows and columns per scale (workers/quantization.FP8_BLOCK)
# Expert layouts differ between llm-compressor's exports: no test holds them to a reference yet.
_UNSUPPORTED_ARCHITECTURES = ("Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


def compressed_tensors_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """QuantizationConfig's fields for the checkpoint, or ValueError naming what is not
    served."""
    fmt = raw.get("format")
    if fmt != FORMAT:
        _refuse("format", fmt, f"only {FORMAT!r} (FP8 weights)")
    groups = raw.get("config_groups") or {}
    schemes = {_scheme_key(g) for g in groups.values()} if isinstance(groups, dict) else set()
    if len(schemes) != 1:
        _refuse("config_groups", groups, "exactly one quantization scheme")
    group = next(iter(groups.values()))
    targets = group.get("targets")
    if targets != ["Linear"]:
        _refuse("config_groups.*.targets", targets, "['Linear']")
    w = group.get("weights") or {}
    _expect("weights.num_bits", w.get("num_bits"), 8, "8-bit weights")
    _expect("weights.type", w.get("type"), "float", "float (FP8) weights")
    _expect("weights.symmetric", w.get("symmetric", True), True, "symmetric weights")
    _expect("weights.dynamic", w.get("dynamic", False), False, "static weight scales")
    strategy = w.get("strategy")
    if strategy not in STRATEGIES:
        _refuse("weights.strategy", strategy, f"one of {STRATEGIES}")
    if strategy == "block":
        blocks = w.get("block_structure")
        if list(blocks or ()) != [BLOCK, BLOCK]:
            _refuse("weights.block_structure", blocks, f"[{BLOCK}, {BLOCK}]")
    acts = group.get("input_activations")
    scheme = "dynamic"
    if acts is not None:
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
