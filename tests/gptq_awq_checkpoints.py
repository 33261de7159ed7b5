"""Tiny random GPTQ (v1 and v2) and AWQ (GEMM) int4 checkpoints for tests, and each one's
full-precision twin: the same model with every projection replaced by exactly the weights the
int4 file encodes ((q - zero) * scale, in float32), which transformers loads as a plain model.

No official packer installs here: transformers reads GPTQ and AWQ only through `gptqmodel`
(which needs torch >= 2.14 and builds from source), AutoAWQ is archived and needs triton. So
the packing below is written from the formats' published descriptions (AutoGPTQ's and
AutoAWQ's `pack` and the GPTQ / AWQ papers' quantizers), independently of kvray's unpacking:

- quantize: per output row and group of `group` input columns (per row: group None), or per
  group of g_idx under activation order; symmetric: scale = 2 max|w| / 15, zero 8;
  asymmetric (and AWQ): scale = (max - min) / 15 over [min(w, 0), max(w, 0)], zero =
  round(-min / scale); q = clamp(round(w / scale) + zero, 0, 15); scales rounded to float16
  (as stored) before q is computed.
- GPTQ: `qweight` [in / 8, out] int32, row r's word of column n holding q[n, 8r + j] at bits
  4j; `qzeros` [groups, out / 8] packed the same way along the output, v1 storing zero - 1;
  `scales` [groups, out] float16; `g_idx` [in] int32.
- AWQ GEMM: `qweight` [in, out / 8], word c of input row k holding q[8c + order[i], k] at bits
  4i with order = [0, 2, 4, 6, 1, 3, 5, 7]; `qzeros` [groups, out / 8] likewise; `scales`
  [groups, out] float16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.fp8_checkpoints import _quantized, make_fp8_checkpoint

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize(w: Any, group: int | None, sym: bool, g_idx: Any = None) -> tuple[Any, Any, Any]:
    """(q [N, K] int64 0..15, scale [N, G] float16, zero [N, G] int64) of `w` [N, K]."""
    import torch

    n, k = w.shape
    if g_idx is None:
        g_idx = torch.arange(k) // (group or k)
    groups = int(g_idx.max()) + 1
    scale = torch.empty(n, groups)
    zero = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            top = torch.maximum(lo.abs(), hi)
            scale[:, g] = torch.where(top > 0, 2 * top / 15, torch.ones_like(top))
            zero[:, g] = 8
        else:
            span = hi - lo
            scale[:, g] = torch.where(span > 0, span / 15, torch.ones_like(span))
            zero[:, g] = torch.round(-lo / scale[:, g].half().float()).long()
    scale = scale.half()
    s, z = scale.float()[:, g_idx], zero[:, g_idx]
    q = (torch.round(w.float() / s) + z).clamp(0, 15).long()
    return q, scale, zero


def dequantized(q: Any, scale: Any, zero: Any, g_idx: Any) -> Any:
    """(q - zero) * scale in float32: what the int4 file encodes."""
    return (q - zero[:, g_idx]).float() * scale.float()[:, g_idx]


def _pack_last(values: Any, order: list[int] | None = None) -> Any:
    """Eight 4-bit values per int32 along the last dim: word c holds values[..., 8c + order[i]]
    at bits 4i (order None: i itself)."""
    import torch

    v = values.long().unflatten(-1, (-1, 8))
    if order is not None:
        v = v[..., order]
    words = sum(v[..., i] << (4 * i) for i in range(8))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def gptq_tensors(
    w: Any, group: int | None, sym: bool, desc_act: bool, v1: bool, seed: int
) -> tuple[dict[str, Any], Any]:
    """A projection's GPTQ tensors, and the float32 weight they encode."""
    import torch

    k = w.shape[1]
    g_idx = torch.arange(k) // (group or k)
    if desc_act:  # columns grouped in a random order, as GPTQ's act-order leaves them
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // group
    q, scale, zero = quantize(w, group, sym, g_idx)
    qweight = _pack_last(q).t()  # [K / 8, N]: packed along the input
    # v1 stores zero - 1, so a zero of 0 cannot be written (readers decode 16): none occurs
    # with these random weights (every group has a negative weight).
    assert not v1 or bool((zero >= 1).all())
    stored_zero = zero - 1 if v1 else zero
    tensors = {
        "qweight": qweight.contiguous(),
        "qzeros": _pack_last(stored_zero.t().contiguous() & 0xF),
        "scales": scale.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, dequantized(q, scale, zero, g_idx)


def awq_tensors(w: Any, group: int) -> tuple[dict[str, Any], Any]:
    """A projection's AWQ GEMM tensors, and the float32 weight they encode."""
    import torch

    g_idx = torch.arange(w.shape[1]) // group
    q, scale, zero = quantize(w, group, sym=False)
    tensors = {
        "qweight": _pack_last(q.t().contiguous(), AWQ_ORDER),  # [K, N / 8]
        "qzeros": _pack_last(zero.t().contiguous(), AWQ_ORDER),  # [G, N / 8]
        "scales": scale.t().contiguous(),
    }
    return tensors, dequantized(q, scale, zero, g_idx)


def _input_seed(name: str) -> int:
    """The same activation order for projections that read the same input (q, k, v; gate,
    up), as GPTQ derives it from that input's statistics."""
    import re
    import zlib

    return zlib.crc32(re.sub(r"\.(q|k|v)_proj\.|\.(gate|up)_proj\.", ".fused.", name).encode())


def make_int4_checkpoint(kind: str, path: Path, group: int | None = 128, **kw: Any) -> Path:
    """`kind` "gptq" (kw: sym, desc_act, v1) or "awq": the dense test Qwen3 at `path`, and its
    full-precision twin at `<path>-twin`."""
    import torch
    from safetensors.torch import load_file, save_file

    sym, desc_act, v1 = kw.get("sym", True), kw.get("desc_act", False), kw.get("v1", True)
    path = Path(path)
    base = make_fp8_checkpoint("qwen3", path.with_name(path.name + "-base"), quantize=False)
    twin = path.with_name(path.name + "-twin")
    for d in (path, twin):
        shutil.copytree(base, d, dirs_exist_ok=True)
    (weights,) = base.glob("*.safetensors")
    packed: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in sorted(load_file(str(weights)).items()):
        if not _quantized(name):
            packed[name] = plain[name] = t
            continue
        if kind == "awq":
            tensors, dense = awq_tensors(t, group or t.shape[1])
        else:
            tensors, dense = gptq_tensors(t, group, sym, desc_act, v1, seed=_input_seed(name))
        prefix = name.removesuffix("weight")
        packed.update({prefix + k: v for k, v in tensors.items()})
        plain[name] = dense
    save_file(packed, str(path / weights.name), metadata={"format": "pt"})
    save_file(plain, str(twin / weights.name), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if kind == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    else:
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group or -1, "sym": sym,
                "desc_act": desc_act, "checkpoint_format": "gptq" if v1 else "gptq_v2"}  # fmt: skip
    config["quantization_config"] = qcfg
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
