"""Reading a PEFT LoRA adapter from disk and checking that it fits the base model.

Supported: what `peft` saves for LoRA on the decoder layers' linear projections (`q_proj`,
`k_proj`, `v_proj`, `o_proj` under `self_attn`; `gate_proj`, `up_proj`, `down_proj` under a
dense `mlp`): `adapter_config.json` plus `adapter_model.safetensors`, keys with or without
peft's `base_model.model.` prefix, weights in any float dtype, plain (`lora_alpha / r`) or
rank-stabilised (`use_rslora`: `lora_alpha / sqrt(r)`) scaling, and per-module ranks and
alphas (`rank_pattern`, `alpha_pattern`, matched against module names as peft matches them).

Everything else is refused with a `LoraError` naming the file and the field, because the
engine adds exactly `x @ A.T @ (scaling * B).T` to a base projection's output and nothing else:
- other PEFT methods, and LoRA variants whose forward is not that sum (DoRA, activated LoRA,
  QALoRA, block-diagonal LoRA, KaSA, ...);
- weights trained besides A and B (`bias`, `lora_bias`, `modules_to_save`, embedding and
  LM-head adapters, trainable tokens): one base model serves every adapter, so nothing of the
  base may change per adapter;
- adapters trained against a changed base: PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA residual
  models (until converted with peft's `path_initial_model_for_weight_conversion`),
  `layer_replication`;
- `fan_in_fan_out` (the transposed layout of GPT-2's Conv1D, which no served family has);
- modules the base model lacks, shapes that differ from the base model's, and MLP adapters on
  mixture-of-experts layers (the experts run in grouped kernels with no per-request delta);
- ranks over `max_lora_rank` (the device slots are that size);
- `adapter_model.bin` (a pickle: loading one can run arbitrary code), non-float or non-finite
  tensors, unreadable files.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILE = "adapter_model.bin"

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {name: "self_attn" if i < 4 else "mlp" for i, name in enumerate(LORA_MODULES)}

_PREFIX = "base_model.model."
# A LoRA factor of one module of one decoder layer; `rest` is the module's path in the layer.
_LAYER_KEY = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)\.lora_(?P<ab>[AB])\.weight")

# Config fields that change the forward beyond `x @ A.T @ B.T * scaling` (or the base model
# itself); refused when set to anything but their off value (None, False, empty).
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA rescales each weight column by a trained magnitude",
    "fan_in_fan_out": "the served models' projections are not transposed (Conv1D) layers",
    "modules_to_save": "the adapter trains full copies of base modules",
    "lora_bias": "the adapter trains a bias on lora_B",
    "trainable_token_indices": "the adapter trains token embeddings",
    "target_parameters": "LoRA on raw parameters (such as MoE experts) is not served",
    "layer_replication": "the adapter duplicates base layers",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens",
    "use_qalora": "QALoRA pools the inputs of A",
    "use_bdlora": "block-diagonal LoRA factors are not served",
    "arrow_config": "Arrow routes among several LoRAs per token",
    "kasa_config": "KaSA truncates the base weights and scales by trained singular values",
    "velora_config": "VeLoRA is not served",
    "monteclora_config": "MonteCLoRA samples its weights",
}
# init_lora_weights values whose adapter belongs to a residual base model (peft subtracts the
# initial adapter from the base weights), not to the published base.
_RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the file and the field."""


@dataclass(frozen=True)
class LoraModule:
    a: torch.Tensor  # [rank, in_features] float32, contiguous (peft's lora_A.weight)
    b: torch.Tensor  # [out_features, rank] float32, contiguous, already times the scaling


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    rank: int  # the largest rank of any module
    modules: dict[tuple[int, str], LoraModule]  # (layer, one of LORA_MODULES) -> full weights

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.a, m.b))


@dataclass(frozen=True)
class _Scaling:
    """The rank and alpha fields of adapter_config.json, resolved per module as peft does."""

    file: str
    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def rank(self, module: str) -> tuple[int, str]:
        """The configured rank of `module` and the field that gives it."""
        key = _pattern_key(self.rank_pattern, module, self.file, "rank_pattern")
        return (self.r, "r") if key is None else (self.rank_pattern[key], f"rank_pattern[{key!r}]")

    def scaling(self, module: str) -> float:
        key = _pattern_key(self.alpha_pattern, module, self.file, "alpha_pattern")
        alpha = self.alpha if key is None else self.alpha_pattern[key]
        r, _ = self.rank(module)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def _pattern_key(patterns: dict[str, Any], module: str, file: str, field: str) -> str | None:
    """peft's matching: the first key (in file order) that matches the module's whole name or a
    dotted suffix of it, as a regular expression."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error as e:
            raise LoraError(f"{file}: {field} key {key!r} is not a valid pattern ({e})") from e
    return None


def load_adapter(
    path: str | os.PathLike[str], model: ModelConfig, max_lora_rank: int
) -> LoraAdapter:
    """Reads the PEFT LoRA adapter in directory `path` and checks it against `model`.

    Raises LoraError (a ValueError) naming the file and the field for anything the engine
    cannot serve exactly (see the module docstring)."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"{root}: the LoRA adapter directory does not exist")
    scaling = _read_config(root / CONFIG_FILE)
    weights_file = root / WEIGHTS_FILE
    if not weights_file.is_file():
        if (root / _PICKLE_FILE).is_file():
            raise LoraError(
                f"{weights_file}: missing; the adapter has only {_PICKLE_FILE} (a pickle, "
                "which can run code when loaded): save it as safetensors "
                "(peft's save_pretrained(..., safe_serialization=True))"
            )
        raise LoraError(f"{weights_file}: the adapter's weights file does not exist")
    factors = _read_factors(weights_file, model)
    modules: dict[tuple[int, str], LoraModule] = {}
    for (layer, name), pair in sorted(factors.items()):
        modules[(layer, name)] = _module(
            str(weights_file), layer, name, pair, model, scaling, max_lora_rank
        )
    if not modules:
        raise LoraError(f"{weights_file}: holds no LoRA weights")
    rank = max(m.a.shape[0] for m in modules.values())
    return LoraAdapter(path=str(root), rank=rank, modules=modules)


def _read_config(file: Path) -> _Scaling:
    if not file.is_file():
        raise LoraError(f"{file}: the adapter's config file does not exist")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{file}: unreadable ({e})") from e
    if not isinstance(cfg, dict):
        raise LoraError(f"{file}: not a JSON object")
    name = str(file)
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise LoraError(f"{name}: peft_type ({peft_type!r}) is not supported, only 'LORA'")
    for field, why in _UNSUPPORTED_FIELDS.items():
        if cfg.get(field) not in (None, False, [], {}, ""):
            raise LoraError(f"{name}: {field} ({cfg[field]!r}) is not supported: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoraError(
            f"{name}: bias ({cfg['bias']!r}) is not supported, only 'none': the adapter "
            "trains the base model's biases"
        )
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_RESIDUAL_INITS):
        raise LoraError(
            f"{name}: init_lora_weights ({init!r}) is not supported: the adapter belongs to a "
            "residual base model; convert it with peft's save_pretrained("
            "path_initial_model_for_weight_conversion=...)"
        )
    r = cfg.get("r", 8)  # peft's defaults
    alpha = cfg.get("lora_alpha", 8)
    if not _is_int(r) or r < 1:
        raise LoraError(f"{name}: r ({r!r}) must be an integer >= 1")
    if not _is_number(alpha):
        raise LoraError(f"{name}: lora_alpha ({alpha!r}) must be a number")
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        _is_int(v) and v >= 1 for v in rank_pattern.values()
    ):
        raise LoraError(f"{name}: rank_pattern ({rank_pattern!r}) must map names to ranks >= 1")
    if not isinstance(alpha_pattern, dict) or not all(
        _is_number(v) for v in alpha_pattern.values()
    ):
        raise LoraError(f"{name}: alpha_pattern ({alpha_pattern!r}) must map names to numbers")
    return _Scaling(
        file=name,
        r=r,
        alpha=float(alpha),
        rslora=bool(cfg.get("use_rslora", False)),
        rank_pattern=rank_pattern,
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _read_factors(
    file: Path, model: ModelConfig
) -> dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]]:
    """The file's tensors as {(layer, module): {"A"|"B": (key, tensor)}}, every key checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoraError(f"{file}: unreadable safetensors file ({e})") from e
    factors: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        layer, name, ab = _parse_key(str(file), key, model)
        pair = factors.setdefault((layer, name), {})
        if ab in pair:
            raise LoraError(f"{file}: {key} and {pair[ab][0]} are the same weight")
        pair[ab] = (key, tensor)
    return factors


def _parse_key(file: str, key: str, model: ModelConfig) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a tensor key, or LoraError saying why it is not served."""
    bare = key.removeprefix(_PREFIX)
    if any(part in bare for part in ("lora_embedding_", "embed_tokens", "lm_head")):
        raise LoraError(
            f"{file}: {key}: adapters on the embeddings or the LM head are not supported"
        )
    match = _LAYER_KEY.fullmatch(bare)
    if match is None:
        raise LoraError(
            f"{file}: {key} is not a LoRA weight of a decoder layer's projection "
            f"(model.layers.N.{{self_attn,mlp}}.{{{','.join(LORA_MODULES)}}}.lora_{{A,B}}.weight)"
        )
    layer, rest = int(match["layer"]), match["rest"]
    if layer >= model.num_layers:
        raise LoraError(
            f"{file}: {key}: layer {layer} does not exist, the base model has "
            f"{model.num_layers} layers"
        )
    block, _, name = rest.rpartition(".")
    moe_part = "experts" in rest.split(".") or rest.startswith(("mlp.", "block_sparse_moe."))
    if moe_part and model.moe is not None and model.moe.is_sparse(layer):
        raise LoraError(
            f"{file}: {key}: layer {layer}'s MLP is a mixture of experts; LoRA on it "
            "(experts, router or MLP projections) is not supported, only on attention"
        )
    if name not in LORA_MODULES or block != _BLOCK[name]:
        raise LoraError(
            f"{file}: {key}: the base model has no module {rest!r} to adapt; supported: "
            + ", ".join(f"{_BLOCK[n]}.{n}" for n in LORA_MODULES)
        )
    return layer, name, match["ab"]


def _features(model: ModelConfig, name: str) -> tuple[int, int]:
    """(in_features, out_features) of the base model's projection `name`."""
    hidden, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[name]


def _module(
    file: str,
    layer: int,
    name: str,
    pair: dict[str, tuple[str, torch.Tensor]],
    model: ModelConfig,
    scaling: _Scaling,
    max_lora_rank: int,
) -> LoraModule:
    for ab, other in (("A", "B"), ("B", "A")):
        if ab in pair and other not in pair:
            key = pair[ab][0]
            raise LoraError(f"{file}: {key} has no lora_{other}.weight to go with it")
    (a_key, a), (b_key, b) = pair["A"], pair["B"]
    for key, t in ((a_key, a), (b_key, b)):
        if not t.is_floating_point():
            raise LoraError(f"{file}: {key} has dtype {t.dtype}, not a floating-point type")
        if t.dim() != 2:
            raise LoraError(f"{file}: {key} has shape {list(t.shape)}, not a matrix")
    module = f"model.layers.{layer}.{_BLOCK[name]}.{name}"
    in_features, out_features = _features(model, name)
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise LoraError(
            f"{file}: {module}: the base model differs in shape: lora_A is {list(a.shape)} "
            f"and lora_B {list(b.shape)}, but the base model's {name} maps {in_features} "
            f"inputs to {out_features} outputs"
        )
    rank = a.shape[0]
    if b.shape[1] != rank:
        raise LoraError(
            f"{file}: {module}: lora_A has rank {rank} but lora_B {list(b.shape)} has {b.shape[1]}"
        )
    configured, field = scaling.rank(module)
    if configured != rank:
        raise LoraError(
            f"{file}: {module} has rank {rank} but {scaling.file} gives {field} = {configured}"
        )
    if rank > max_lora_rank:
        raise LoraError(f"{scaling.file}: {field} ({rank}) is over max_lora_rank ({max_lora_rank})")
    a32 = a.to(torch.float32).contiguous()
    b32 = (b.to(torch.float32) * scaling.scaling(module)).contiguous()
    for key, t in ((a_key, a32), (b_key, b32)):
        if not bool(torch.isfinite(t).all()):
            raise LoraError(f"{file}: {key} holds NaN or infinite values")
    return LoraModule(a=a32, b=b32)
