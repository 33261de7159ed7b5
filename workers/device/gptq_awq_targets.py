"""Where a GPTQ or AWQ checkpoint's tensors go (workers/gptq_awq.py reads their configs): each
projection's `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`), this rank's part only,
converted at load into the int4 layers' one in-memory form (workers/device/layers/
int4_linear.py: `weight_packed` int32 [out, in / 8] packed along the input, `weight_scale`
[out, groups], `weight_zero` uint8 [out, groups], `g_idx`).

- GPTQ packs `qweight` [in / 8, out] along the input, lowest bits first, as the layer does:
  its transpose is the layer's. `qzeros` [groups, out / 8] are packed along the output; v1
  checkpoints ("gptq", the usual one) store each zero point minus one, v2 as it is. A
  row-parallel rank of an activation-order (desc_act) checkpoint reads every group's scales
  and zeros: its columns may belong to any group.
- AWQ (GEMM) packs `qweight` [in, out / 8] and `qzeros` [groups, out / 8] along the output in
  its interleaved order (nibble i of a word holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]):
  they are unpacked, reordered, and the weight repacked along the input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workers.device.int4_tensor import FLOATS, Int4Target, SplitLike, check_cut, part_range
from workers.device.layers.int4_linear import PACK, pack_int4, unpack_int4

_INT32 = (torch.int32,)
# Column 8c + j of an AWQ word is its nibble _AWQ_COLUMN_NIBBLE[j].
_AWQ_COLUMN_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]
Read = Callable[[Any], torch.Tensor]


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved words [..., w] -> the values 0..15 in column order, [..., 8w]."""
    q = unpack_int4(words, words.shape[-1] * PACK).unflatten(-1, (-1, PACK))
    return q[..., _AWQ_COLUMN_NIBBLE].flatten(-2)


def _columns(start: int, size: int) -> tuple[int, int, int]:
    """The packed words covering columns [start, start + size) and the first one's offset."""
    first = start // PACK
    return first, -(-(start + size) // PACK), start - first * PACK


def gptq_awq_targets(
    name: str, module: Any, split: SplitLike, part: int | None
) -> dict[str, Int4Target]:
    """Targets of projection `name` of a GPTQ or AWQ checkpoint, its fused part `part`."""
    awq = module.quant.layout == "awq"
    rows_split = split.axis == "rows"
    offset = 0 if part is None else module.part_offset(part)
    n = split.full if rows_split else module.weight_packed.shape[0]  # output rows
    k = module.in_features if rows_split else split.full  # input columns
    group = module.col_block
    groups = 1 if group is None else -(-k // group)
    words_n = -(-n // PACK)
    start, size = split.start, split.size
    act_order = module.g_idx is not None
    if rows_split:  # this rank's output columns of the [in, out]-shaped tensors
        check_cut(name + ".qzeros", split, PACK, "zero points (packed eight columns per int32)")
        w0, w1, skip = _columns(start, size)
        cols: Read = lambda s: s[:, start : start + size]  # noqa: E731
        packed_cols: Read = lambda s: s[:, w0:w1]  # noqa: E731
        zeros = _zeros(awq, module.quant.layout, packed_cols, skip, size)
        if awq:
            weight = lambda s: pack_int4(unpack_awq(s[:, w0:w1])[:, skip : skip + size].t())  # noqa: E731
        else:
            weight = lambda s: cols(s).t()  # noqa: E731
        scales = lambda s: cols(s).t()  # noqa: E731
        g_idx: Read = lambda s: s[:]  # noqa: E731
    else:  # this rank's input rows, their groups (every group under activation order)
        check_cut(name + ".qweight", split, PACK, "packed weight words (eight columns)")
        if not act_order:
            check_cut(name + ".scales", split, group, f"scale groups of {group} columns")
        g0, g1 = (0, groups) if act_order else part_range(start, size, group, groups)
        group_rows: Read = lambda s: s[g0:g1]  # noqa: E731
        zeros = _zeros(awq, module.quant.layout, group_rows, 0, n)
        if awq:
            weight = lambda s: pack_int4(unpack_awq(s[start : start + size]).t())  # noqa: E731
        else:
            weight = lambda s: s[start // PACK : -(-(start + size) // PACK)].t()  # noqa: E731
        scales = lambda s: group_rows(s).t()  # noqa: E731
        g_idx = lambda s: s[start : start + size]  # noqa: E731
    qweight_shape = (k, words_n) if awq else (-(-k // PACK), n)
    out = {
        f"{name}.qweight": Int4Target(module.weight_packed, qweight_shape, _INT32, weight, offset),
        f"{name}.qzeros": Int4Target(module.weight_zero, (groups, words_n), _INT32, zeros, offset),
        f"{name}.scales": Int4Target(module.weight_scale, (groups, n), FLOATS, scales, offset),
    }
    if module.bias is None:
        # AutoGPTQ's and AutoAWQ's layers save a bias for every projection, zeros where the
        # model has none: read and checked, never required.
        out[f"{name}.bias"] = Int4Target(
            None, (n,), FLOATS, lambda s: s[:], check=_zero_bias, optional=True
        )
    if not awq:  # GPTQ always writes g_idx: each column's group (k // group unless desc_act)
        param = module.g_idx if act_order else None
        if act_order:
            check = _same_g_idx(module, name, part)
        else:
            check = _trivial_g_idx(group, start if not rows_split else 0)
        out[f"{name}.g_idx"] = Int4Target(param, (k,), _INT32, g_idx, check=check)
    return out


def _same_g_idx(module: Any, name: str, part: int | None) -> Callable[[torch.Tensor], None]:
    """The parts of a fused projection (q, k, v; gate, up) read one input, so GPTQ gives them
    one activation order; the layer holds one g_idx: a part whose differs is refused."""
    loaded: set[int] = module.__dict__.setdefault("_g_idx_parts", set())

    def check(t: torch.Tensor) -> None:
        if loaded and not torch.equal(module.g_idx.data, t.to(module.g_idx.dtype)):
            raise ValueError(
                f"g_idx differs from the other parts of {name}'s fused projection (one input, "
                "one activation order)"
            )
        loaded.add(-1 if part is None else part)

    return check


def _zeros(awq: bool, layout: str, read: Read, skip: int, size: int) -> Read:
    """The zero points of this rank's part, uint8 [rows, groups]: unpacked (AWQ's order
    undone), v1 GPTQ's stored minus one added back."""
    unpack = unpack_awq if awq else (lambda w: unpack_int4(w, w.shape[-1] * PACK))
    plus = 1 if layout == "gptq" else 0

    def zeros(s: Any) -> torch.Tensor:
        z = unpack(read(s))[:, skip : skip + size].t()
        return z + plus  # uint8: v1's 15 (a zero of 16, its overflow) stays representable

    return zeros


def _trivial_g_idx(group: int | None, first: int) -> Callable[[torch.Tensor], None]:
    """Without activation order, column k must be in group k // group_size (per channel: 0)."""

    def check(t: torch.Tensor) -> None:
        cols = torch.arange(first, first + t.numel())
        want = torch.zeros_like(cols) if group is None else cols // group
        if not torch.equal(t.long(), want):
            raise ValueError(
                "g_idx is not column // group_size, but desc_act is false: an activation-order "
                "checkpoint must say desc_act: true"
            )

    return check


def _zero_bias(t: torch.Tensor) -> None:
    if bool(t.any()):
        raise ValueError("a bias on a projection this model has none on (only zeros are read)")
