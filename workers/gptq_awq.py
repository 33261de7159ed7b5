"""config.json's `quantization_config` of a GPTQ or AWQ checkpoint, read into the fields of a
QuantizationConfig (workers/quantization.py builds it; this module imports nothing of it).
Both are int4 weight-only: their tensors are converted at load into the int4 layers' one
in-memory form (workers/device/gptq_awq_targets.py, workers/device/layers/int4_linear.py).

Served:
- GPTQ (`quant_method: "gptq"`, AutoGPTQ / GPTQModel / optimum): `bits: 4`, `group_size` a
  positive group of input columns or -1 (one group: per output channel), `desc_act` true or
  false (activation order: a `g_idx` gives each input column's group), `sym` true or false;
  `checkpoint_format` (or `format`) "gptq" (v1: zero points stored minus one, the usual
  layout on the Hub) or "gptq_v2" (stored as they are). Per projection: `qweight` int32
  [in / 8, out] packed along the input, `qzeros` int32 [groups, out / 8] packed along the
  output, `scales` [groups, out], `g_idx` int32 [in].
- AWQ GEMM (`quant_method: "awq"`, AutoAWQ's default `version: "gemm"`): `bits` (`w_bit`) 4,
  a positive `group_size` (`q_group_size`), `zero_point: true`. Per projection: `qweight`
  int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], both packed along the output in
  AWQ's interleaved order (word nibble i holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]),
  `scales` [groups, out].
The weight is (q - zero) * scale in both. Refused with the field and its value named: other
bit widths, AWQ's GEMV / Exllama / Marlin layouts and its zero_point false, a quantized LM
head (GPTQ's `lm_head: true`), and mixture-of-experts models (their expert layout is not read).
"""

from __future__ import annotations

from typing import Any

_UNSUPPORTED_ARCHITECTURES = ("Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
GPTQ_FORMATS = {"gptq": "gptq", "gptq_v2": "gptq_v2"}  # checkpoint_format -> layout


def gptq_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """QuantizationConfig's fields for a GPTQ checkpoint, or ValueError naming what is not
    served."""
    _expect("gptq", "bits", raw.get("bits"), 4, "4-bit weights")
    fmt = raw.get("checkpoint_format", raw.get("format", "gptq"))
    if fmt not in GPTQ_FORMATS:
        _refuse("gptq", "checkpoint_format", fmt, f"one of {tuple(GPTQ_FORMATS)}")
    for flag in ("desc_act", "sym"):
        if raw.get(flag, flag == "sym") not in (True, False):
            _refuse("gptq", flag, raw.get(flag), "true or false")
    _expect("gptq", "lm_head", raw.get("lm_head", False), False, "a full-precision LM head")
    group = raw.get("group_size", 128)
    fields = _group_fields("gptq", "group_size", group, allow_channel=True)
    _check_arch("GPTQ", arch)
    return {
        **fields,
        "method": "gptq",
        "layout": GPTQ_FORMATS[fmt],
        "zero_point": not raw.get("sym", True),
        # Per channel every column is in group 0: the order changes nothing.
        "act_order": bool(raw.get("desc_act", False)) and fields["strategy"] == "group",
        "modules_to_not_convert": _skip(raw),
    }


def awq_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """QuantizationConfig's fields for an AWQ checkpoint, or ValueError naming what is not
    served."""
    bits_key = "bits" if "bits" in raw else "w_bit"
    _expect("awq", bits_key, raw.get(bits_key), 4, "4-bit weights")
    version = raw.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        _refuse("awq", "version", version, "the 'gemm' layout (AutoAWQ's default)")
    _expect("awq", "zero_point", raw.get("zero_point", True), True, "zero points")
    group_key = "group_size" if "group_size" in raw else "q_group_size"
    fields = _group_fields("awq", group_key, raw.get(group_key), allow_channel=False)
    _check_arch("AWQ", arch)
    return {
        **fields,
        "method": "awq",
        "layout": "awq",
        "zero_point": True,
        "modules_to_not_convert": _skip(raw),
    }


def _group_fields(method: str, key: str, group: Any, allow_channel: bool) -> dict[str, Any]:
    if allow_channel and group == -1:
        return {"weights": "int4", "strategy": "channel", "scale_name": "scales"}
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        served = "a positive group size" + (" or -1 (per channel)" if allow_channel else "")
        _refuse(method, key, group, served)
    return {
        "weights": "int4",
        "strategy": "group",
        "weight_block_size": (1, group),
        "scale_name": "scales",
    }


def _skip(raw: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(x) for x in raw.get("modules_to_not_convert") or ())


def _check_arch(what: str, arch: str) -> None:
    if arch in _UNSUPPORTED_ARCHITECTURES:
        raise ValueError(f"{what} checkpoints of {arch} are not supported yet")


def _expect(method: str, field: str, value: Any, want: Any, supported: str) -> None:
    if value != want:
        _refuse(method, field, value, f"{supported} ({want!r})")


def _refuse(method: str, field: str, value: Any, supported: str) -> None:
    raise ValueError(
        f"unsupported quantization_config.{field} {value!r} for quant_method {method!r}: kvray "
        f"serves {supported}"
    )
