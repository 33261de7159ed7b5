"""safetensors checkpoint -> this rank's weight shard.

Each tensor is read through safetensors' lazy slices (memory-mapped), so a rank reads only
the rows/columns it owns and peak host memory stays near one shard, never the full model.

FP8 and int8 projections (workers/quantization.py) are read as stored, their scales sliced
along the same split (`_linear`); int4 ones by workers/device/int4_targets.py. A wrong dtype
or scale shape, a missing scale or a shard cutting a block or group is refused, tensor named.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from workers.config import ModelConfig
from workers.device.distributed import TPGroup
from workers.device.int4_targets import int4_targets
from workers.device.layers.embedding import padded_vocab
from workers.device.layers.fp8_linear import FP8_DTYPE, blocks
from workers.device.layers.int8_linear import INT8_DTYPE
from workers.device.layers.moe import SparseMoeBlock
from workers.device.models.llama import LlamaForCausalLM
from workers.gguf import gguf_tensors, is_gguf
from workers.quantization import FP8_BLOCK

log = logging.getLogger(__name__)

# A "slicer" takes a lazy safetensors slice and returns the part this rank owns.
Slicer = Callable[[object], torch.Tensor]


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"checkpoint index names missing files: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


def _rows(start: int, size: int) -> Slicer:
    return lambda s: s[start : start + size]


def _cols(start: int, size: int) -> Slicer:
    return lambda s: s[:, start : start + size]


def _full(s) -> torch.Tensor:  # noqa: ANN001
    return s[:]


class _Target:
    """Where one checkpoint tensor goes: a parameter, an offset into its rows, a slicer, and
    what turns the checkpoint's values into the parameter's (Gemma's norms fold 1 + w);
    `full_shape`: the whole tensor's shape, checked before slicing (an FP8 scale grid)."""

    def __init__(
        self,
        param: torch.Tensor,
        slicer: Slicer,
        row_offset: int | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        full_shape: tuple[int, ...] | None = None,
        full_shape_what: str = "128x128 block",
        full_shape_kind: str = "FP8",
    ):
        self.param, self.slicer, self.row_offset = param, slicer, row_offset
        self.transform, self.full_shape = transform, full_shape
        self.full_shape_what, self.full_shape_kind = full_shape_what, full_shape_kind

    def load(self, lazy) -> None:  # noqa: ANN001
        shape = tuple(lazy.get_shape())
        if len(shape) < 2 and shape in ((), (1,)):  # a per-tensor scale stored as one number
            shape = (1, 1)
        if self.full_shape is not None and shape != self.full_shape:
            raise ValueError(
                f"{self.full_shape_kind} scale grid of shape {tuple(lazy.get_shape())}, expected "
                f"{self.full_shape} (one scale per {self.full_shape_what} of the weight)"
            )
        t = self.slicer(lazy)
        if self.transform is not None:
            t = self.transform(t)
        dst = self.param.data
        _check_dtype(t.dtype, dst.dtype)
        if self.row_offset is not None:
            dst = dst[self.row_offset : self.row_offset + t.shape[0]]
        if dst.shape != t.shape:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(t.shape)} vs model {tuple(dst.shape)}"
            )
        dst.copy_(t.to(dst.dtype))


_QUANTIZED = {  # a quantized dtype: whose projections, stored how, in messages
    FP8_DTYPE: ("an FP8", "float8_e4m3fn with a weight_scale_inv", "fp8", "FP8"),
    INT8_DTYPE: ("an int8 (W8A16)", "int8 with a weight_scale", "int8", "int8"),
}


def _check_dtype(stored: torch.dtype, held: torch.dtype) -> None:
    """A quantized parameter takes only values of its dtype, and they only such a parameter."""
    for dtype, (whose, stored_as, says, name) in _QUANTIZED.items():
        if held == dtype and stored != dtype:
            raise ValueError(
                f"stored as {stored}, but {whose} checkpoint's attention and MLP projections "
                f"must be {stored_as} (full-precision projections are not supported yet)"
            )
        if stored == dtype and held != dtype:
            raise ValueError(
                f"stored as {stored}, but kvray holds this tensor in {held}: only the attention "
                f"and MLP projections of a checkpoint whose quantization_config says {says} are "
                f"read as {name} (quantized embeddings, LM heads and routers: not supported yet)"
            )
    if held == torch.float32 and stored not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"stored as {stored}, expected a floating-point tensor")


@dataclass(frozen=True)
class _Split:
    """This rank's part of a projection: [start, start + size) of the checkpoint's `full`
    rows (column-parallel) or columns (row-parallel), among `ranks` ranks."""

    axis: str  # "rows" | "cols"
    start: int
    size: int
    full: int
    ranks: int

    def slicer(self, start: int, size: int) -> Slicer:
        return (_rows if self.axis == "rows" else _cols)(start, size)


@dataclass(frozen=True)
class _Scales:
    """A quantized projection's scales: weight rows and columns per scale (None: all of them;
    fp8_linear.py, int8_linear.py), the checkpoint's name for them, the weights' kind."""

    rows: int | None = FP8_BLOCK
    cols: int | None = FP8_BLOCK
    name: str = "weight_scale_inv"
    kind: str = "FP8"  # "FP8" | "int8", for messages

    def what(self) -> str:
        if self.rows is None and self.cols is None:
            return "tensor"
        if self.rows == 1:
            return "output channel" if self.cols is None else f"group of {self.cols} columns"
        return f"{self.rows}x{self.cols} block"


def _as_grid(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(1, 1)  # a per-tensor scale stored as one number


def _linear(
    name: str,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    split: _Split,
    offsets: tuple[int, int] | None = None,
    scales: _Scales = _Scales(),
) -> dict[str, _Target]:
    """Projection `name`'s targets: `weight` (a parameter, or one expert's slot) takes the
    rank's `split`, at row `offsets[0]` of a fused weight (None: the whole parameter). An FP8
    layer's (`scale` not None) scale grid takes the scales of that split (all of them where
    one scale spans the split axis), at grid row `offsets[1]`."""
    row, grid_row = offsets if offsets is not None else (None, None)
    out = {f"{name}.weight": _Target(weight, split.slicer(split.start, split.size), row)}
    if scale is None:
        return out
    start, end = split.start, split.start + split.size
    along = scales.rows if split.axis == "rows" else scales.cols
    if along is None:  # one scale spans the split axis: every rank reads all of it
        grid_slicer: Slicer = _full
    else:
        if start % along or (split.size % along and end != split.full):
            raise ValueError(
                f"{name}: tensor_parallel_size ({split.ranks}) gives a rank {split.axis} "
                f"[{start}, {end}) of {split.full}, which cuts its {scales.kind} {scales.what()} "
                f"scales"
            )
        first = start // along
        grid_slicer = split.slicer(first, blocks(end, along) - first)
    rows, cols = (
        (split.full, weight.shape[-1]) if split.axis == "rows" else (weight.shape[-2], split.full)
    )
    grid = (blocks(rows, scales.rows), blocks(cols, scales.cols))
    what, kind = scales.what(), scales.kind
    out[f"{name}.{scales.name}"] = _Target(scale, grid_slicer, grid_row, _as_grid, grid, what, kind)
    return out


def _proj(
    name: str,
    module: torch.nn.Module,
    split: _Split,
    part: int | None = None,
    scale_name: str = "weight_scale_inv",
) -> dict[str, _Target]:
    """`_linear` of projection `module` (full precision, FP8, int8), fused part `part`."""
    if hasattr(module, "weight_packed"):  # int4: its own tensor names and in-memory form
        return int4_targets(name, module, split, part)  # type: ignore[return-value]
    scale = getattr(module, "weight_scale_inv", getattr(module, "weight_scale", None))
    offsets = None
    if part is not None:
        grid_row = module.scale_offset(part) if scale is not None else 0
        offsets = (module.part_offset(part), grid_row)
    if scale is None:
        return _linear(name, module.weight, None, split, offsets)
    kind = "int8" if module.weight.dtype == INT8_DTYPE else "FP8"
    scales = _Scales(module.row_block, module.col_block, scale_name, kind)
    return _linear(name, module.weight, scale, split, offsets, scales)


def _targets(model: LlamaForCausalLM, c: ModelConfig, tp: TPGroup) -> dict[str, _Target]:
    hd = c.head_dim
    q_per = c.num_heads // tp.size * hd
    kvh = c.kv_heads_per_rank(tp.size)
    if tp.size >= c.num_kv_heads:  # replicated KV heads: this rank's single head
        kv_start = (tp.rank // (tp.size // c.num_kv_heads)) * hd
    else:
        kv_start = tp.rank * kvh * hd
    kv_per = kvh * hd
    inter = c.intermediate_size // tp.size
    vocab_per = padded_vocab(c.vocab_size, tp) // tp.size
    vocab_start = tp.rank * vocab_per
    vocab_rows = max(0, min(vocab_per, c.vocab_size - vocab_start))

    # The checkpoint's name for a projection's FP8 or int8 scales (workers/quantization.py).
    sn = c.quantization.scale_name if c.quantization is not None else "weight_scale_inv"
    out: dict[str, _Target] = {
        "model.embed_tokens.weight": _Target(
            model.embed_tokens.weight, _rows(vocab_start, vocab_rows), row_offset=0
        ),
        "model.norm.weight": _norm(model.norm),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = _Target(
            model.lm_head.weight, _rows(vocab_start, vocab_rows), row_offset=0
        )
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.self_attn, layer.mlp
        qkv = a.qkv_proj
        for norm in _LAYER_NORMS:  # Gemma 3 has all four, the others the first two
            if hasattr(layer, norm):
                out[p + f"{norm}.weight"] = _norm(getattr(layer, norm))
        if c.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = _Target(qkv.bias, _rows(tp.rank * q_per, q_per), 0)
            for i_part, part in ((1, "k_proj"), (2, "v_proj")):
                out[p + f"self_attn.{part}.bias"] = _Target(
                    qkv.bias, _rows(kv_start, kv_per), qkv.part_offset(i_part)
                )
        q_split = _Split("rows", tp.rank * q_per, q_per, c.num_heads * hd, tp.size)
        kv_split = _Split("rows", kv_start, kv_per, c.num_kv_heads * hd, tp.size)
        for j, (part, split) in enumerate((("q", q_split), ("k", kv_split), ("v", kv_split))):
            out.update(_proj(p + f"self_attn.{part}_proj", qkv, split, j, sn))
        o_split = replace(q_split, axis="cols")
        out.update(_proj(p + "self_attn.o_proj", a.o_proj, o_split, scale_name=sn))
        if a.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = _norm(a.q_norm)
            out[p + "self_attn.k_norm.weight"] = _norm(a.k_norm)
        if isinstance(m, SparseMoeBlock):
            out.update(_moe_targets(p, m, c, tp.size))
            continue
        mlp_split = _Split("rows", tp.rank * inter, inter, c.intermediate_size, tp.size)
        for j, part in enumerate(("gate_proj", "up_proj")):
            out.update(_proj(p + f"mlp.{part}", m.gate_up_proj, mlp_split, j, sn))
        down_split = replace(mlp_split, axis="cols")
        out.update(_proj(p + "mlp.down_proj", m.down_proj, down_split, scale_name=sn))
    return out


_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _norm(module: torch.nn.Module) -> _Target:
    """A norm's weight, whole on every rank, through the module's `from_checkpoint` if it has
    one (GemmaRMSNorm stores 1 + w)."""
    return _Target(module.weight, _full, transform=getattr(module, "from_checkpoint", None))


def _moe_targets(
    prefix: str, m: SparseMoeBlock, c: ModelConfig, tp_size: int
) -> dict[str, _Target]:
    """A sparse layer's router and experts: each checkpoint expert's gate/up/down matrices go
    into this rank's slot of the stacked weights, sliced to its part of the intermediate dim."""
    assert c.moe is not None
    part = m.partition
    block = prefix + c.moe.block_name
    gate_name, up_name, down_name = c.moe.expert_names
    start, inter = part.inter_start, part.inter_size
    out = {f"{block}.gate.weight": _Target(m.gate, _full)}
    for expert in range(c.moe.num_experts):
        e = part.local_index(expert)
        name = f"{block}.experts.{expert}."
        if e is None:  # held by another rank (expert parallelism): expected, never read
            for n in _expert_names(name, c.moe.expert_names, m.w13_scale_inv is not None):
                out[n] = _SKIP
            continue
        split = _Split("rows", start, inter, c.moe.intermediate_size, tp_size)
        s13 = None if m.w13_scale_inv is None else m.w13_scale_inv[e]
        s2 = None if m.w2_scale_inv is None else m.w2_scale_inv[e]
        for j, proj in enumerate((gate_name, up_name)):  # gate rows first, then up's
            offsets = (j * inter, j * blocks(inter))
            out.update(_linear(name + proj, m.w13[e], s13, split, offsets))
        out.update(_linear(name + down_name, m.w2[e], s2, replace(split, axis="cols")))
    return out


def _expert_names(prefix: str, names: tuple[str, str, str], fp8: bool) -> list[str]:
    suffixes = ("weight", "weight_scale_inv") if fp8 else ("weight",)
    return [f"{prefix}{n}.{suffix}" for n in names for suffix in suffixes]


class _Skipped(_Target):
    """A checkpoint tensor this rank does not hold: its bytes are never read."""

    def __init__(self) -> None:
        pass

    def load(self, lazy) -> None:  # noqa: ANN001
        pass


_SKIP = _Skipped()


def _tensors(files: list[Path]) -> Iterator[tuple[str, object]]:
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, fh.get_slice(name)


# A checkpoint's FP8 KV-cache scales (per layer, one for K and one for V): read into the
# layer's attention, used when the KV cache is FP8 (workers/device/layers/kv_quant.py).
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def _load_kv_scale(
    model: LlamaForCausalLM, layer: int, which: str, lazy: object, name: str
) -> None:
    t = lazy[...].float()  # a 0-dim tensor or one of shape [1]
    if t.numel() != 1 or not bool(torch.isfinite(t).all()) or float(t) <= 0:
        raise ValueError(f"{name}: a KV-cache scale must be one positive number, got {t.tolist()}")
    if layer >= len(model.layers):
        raise ValueError(f"unexpected tensor {name!r}: the model has {len(model.layers)} layers")
    setattr(model.layers[layer].self_attn.attn, f"{which}_scale", float(t))


def load_weights(
    model: LlamaForCausalLM, c: ModelConfig, tp: TPGroup, progress: bool = False
) -> None:
    targets = _targets(model, c, tp)
    seen: set[str] = set()  # items: a GGUF file's tensors renamed, converted (workers/gguf/)
    items = gguf_tensors(c) if is_gguf(c.path) else _tensors(checkpoint_files(Path(c.path)))
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="loading weights", unit="tensor", leave=False)
    for name, lazy in items:
        target = targets.get(name)
        if target is None:
            if c.tie_word_embeddings and name == "lm_head.weight":
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if (kv := _KV_SCALE.fullmatch(name)) is not None:
                _load_kv_scale(model, int(kv.group(1)), kv.group(2), lazy, name)
                continue
            raise ValueError(f"unexpected tensor {name!r} in checkpoint {c.path}")
        try:
            target.load(lazy)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        seen.add(name)
    missing = sorted(n for n in set(targets) - seen if not getattr(targets[n], "optional", 0))
    if missing:
        raise ValueError(f"checkpoint {c.path} is missing tensors: {', '.join(missing[:8])}")
