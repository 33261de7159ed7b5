"""safetensors checkpoint -> this rank's weight shard.

Each tensor is read through safetensors' lazy slices (memory-mapped), so a rank reads only
the rows/columns it owns and peak host memory stays near one shard, never the full model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from workers.config import ModelConfig
from workers.device.distributed import TPGroup
from workers.device.layers.embedding import padded_vocab
from workers.device.layers.moe import SparseMoeBlock
from workers.device.models.llama import LlamaForCausalLM

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
    what turns the checkpoint's values into the parameter's (Gemma's norms fold 1 + w)."""

    def __init__(
        self,
        param: torch.Tensor,
        slicer: Slicer,
        row_offset: int | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.param, self.slicer, self.row_offset = param, slicer, row_offset
        self.transform = transform

    def load(self, lazy) -> None:  # noqa: ANN001
        t = self.slicer(lazy)
        if self.transform is not None:
            t = self.transform(t)
        dst = self.param.data
        if self.row_offset is not None:
            dst = dst[self.row_offset : self.row_offset + t.shape[0]]
        if dst.shape != t.shape:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(t.shape)} vs model {tuple(dst.shape)}"
            )
        dst.copy_(t.to(dst.dtype))


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
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            param = getattr(qkv, kind)
            out[p + f"self_attn.q_proj.{kind}"] = _Target(param, _rows(tp.rank * q_per, q_per), 0)
            out[p + f"self_attn.k_proj.{kind}"] = _Target(
                param, _rows(kv_start, kv_per), qkv.part_offset(1)
            )
            out[p + f"self_attn.v_proj.{kind}"] = _Target(
                param, _rows(kv_start, kv_per), qkv.part_offset(2)
            )
        out[p + "self_attn.o_proj.weight"] = _Target(a.o_proj.weight, _cols(tp.rank * q_per, q_per))
        if a.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = _norm(a.q_norm)
            out[p + "self_attn.k_norm.weight"] = _norm(a.k_norm)
        if isinstance(m, SparseMoeBlock):
            out.update(_moe_targets(p, m, c))
            continue
        gu = m.gate_up_proj.weight
        out[p + "mlp.gate_proj.weight"] = _Target(gu, _rows(tp.rank * inter, inter), 0)
        out[p + "mlp.up_proj.weight"] = _Target(gu, _rows(tp.rank * inter, inter), inter)
        out[p + "mlp.down_proj.weight"] = _Target(m.down_proj.weight, _cols(tp.rank * inter, inter))
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


def _moe_targets(prefix: str, m: SparseMoeBlock, c: ModelConfig) -> dict[str, _Target]:
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
            for n in _expert_names(name, c.moe.expert_names):
                out[n] = _SKIP
            continue
        out[name + f"{gate_name}.weight"] = _Target(m.w13[e], _rows(start, inter), 0)
        out[name + f"{up_name}.weight"] = _Target(m.w13[e], _rows(start, inter), inter)
        out[name + f"{down_name}.weight"] = _Target(m.w2[e], _cols(start, inter))
    return out


def _expert_names(prefix: str, names: tuple[str, str, str]) -> list[str]:
    return [f"{prefix}{n}.weight" for n in names]


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


def load_weights(
    model: LlamaForCausalLM, c: ModelConfig, tp: TPGroup, progress: bool = False
) -> None:
    targets = _targets(model, c, tp)
    files = checkpoint_files(Path(c.path))
    seen: set[str] = set()
    items = _tensors(files)
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
            raise ValueError(f"unexpected tensor {name!r} in checkpoint {c.path}")
        try:
            target.load(lazy)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise ValueError(f"checkpoint {c.path} is missing tensors: {', '.join(missing[:8])}")
