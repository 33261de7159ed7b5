"""Where an int4 (W4A16) checkpoint's tensors go: a projection's packed weight, scales, zero
points (and GPTQ's g_idx) read into its layer (workers/device/layers/int4_linear.py), this
rank's part of them only, converted to the layer's one in-memory form (the targets and their
shared checks: workers/device/int4_tensor.py).

workers/device/loader.py hands each int4 projection here (`int4_targets`); everything else
of the checkpoint it reads itself. Each target checks the whole tensor's shape and dtype
before slicing, so a wrong file is refused with the tensor named (the loader prefixes it),
and refuses a tensor-parallel shard that would cut a packed word or a scale group.

compressed-tensors' pack-quantized layout (the layer's own): `weight_packed` int32
[out, in / 8] (rows or words sliced), `weight_scale` [out, groups], `weight_shape` [2]
(checked, not stored), `weight_zero_point` int32 [out / 8, groups] packed along the rows
(unpacked at load into the layer's uint8 zeros); kvray's own `weight_offset` float32
[out, groups] (GGUF Q4_K, workers/gguf/int4.py: no compressed-tensors checkpoint has it).
GPTQ and AWQ: workers/device/gptq_awq_targets.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workers.device.gptq_awq_targets import gptq_awq_targets
from workers.device.int4_tensor import (
    FLOATS,
    Int4Target,
    SplitLike,
    check_cut,
    part_range,
    unpack_rows,
)
from workers.device.layers.int4_linear import PACK


def int4_targets(
    name: str, module: Any, split: SplitLike, part: int | None
) -> dict[str, Int4Target]:
    """Targets of projection `name` (compressed-tensors' names; GPTQ and AWQ through
    workers/device/gptq_awq_targets.py), its fused part `part` (None: not fused), this rank's
    `split`."""
    layout = module.quant.layout
    if layout != "compressed-tensors":
        return gptq_awq_targets(name, module, split, part)
    rows_split = split.axis == "rows"
    offset = 0 if part is None else module.part_offset(part)
    full_rows = split.full if rows_split else module.weight_packed.shape[0]
    full_cols = module.in_features if rows_split else split.full
    group = module.col_block
    groups = 1 if group is None else -(-full_cols // group)
    if rows_split:
        check_cut(name + ".weight_zero_point", split, PACK if module.quant.zero_point else None,
                  "zero points (packed eight rows per int32)")  # fmt: skip
        start, size = split.start, split.size
        w_read = lambda s: s[start : start + size]  # noqa: E731
        s_read = w_read
    else:
        check_cut(name + ".weight_packed", split, PACK, "packed weight words (eight columns)")
        check_cut(name + ".weight_scale", split, group, f"scale groups of {group} columns")
        w0, w1 = part_range(split.start, split.size, PACK, -(-full_cols // PACK))
        g0, g1 = part_range(split.start, split.size, group, groups)
        w_read = lambda s: s[:, w0:w1]  # noqa: E731
        s_read = lambda s: s[:, g0:g1]  # noqa: E731
    out = {
        f"{name}.weight_packed": Int4Target(
            module.weight_packed, (full_rows, -(-full_cols // PACK)), (torch.int32,), w_read, offset
        ),
        f"{name}.weight_scale": Int4Target(
            module.weight_scale, (full_rows, groups), FLOATS, s_read, offset
        ),
        f"{name}.weight_shape": Int4Target(
            None,
            (2,),
            (torch.int64, torch.int32),
            lambda s: s[:],
            check=_shape_is(full_rows, full_cols),
        ),
    }
    if module.quant.offset:  # GGUF Q4_K's float offsets, sliced as the scales are
        out[f"{name}.weight_offset"] = Int4Target(
            module.weight_offset, (full_rows, groups), (torch.float32,), s_read, offset
        )
    if module.quant.zero_point:
        out[f"{name}.weight_zero_point"] = Int4Target(
            module.weight_zero,
            (-(-full_rows // PACK), groups),
            (torch.int32,),
            _zero_reader(split, full_rows, group, groups),
            offset,
        )
    return out


def _zero_reader(
    split: SplitLike, full_rows: int, group: int | None, groups: int
) -> Callable[[Any], torch.Tensor]:
    """compressed-tensors' zero points, packed along the rows, for this rank's rows (or its
    groups' columns): stored as zero_point + 8, exactly the layer's `weight_zero`."""
    if split.axis == "rows":
        first = split.start // PACK
        last = -(-(split.start + split.size) // PACK)
        skip = split.start - first * PACK

        def rows(s: Any) -> torch.Tensor:
            z = unpack_rows(s[first:last], (last - first) * PACK)
            return z[skip : skip + split.size]

        return rows
    g0, g1 = part_range(split.start, split.size, group, groups)
    return lambda s: unpack_rows(s[:, g0:g1], full_rows)


def _shape_is(rows: int, cols: int) -> Callable[[torch.Tensor], None]:
    def check(t: torch.Tensor) -> None:
        if t.tolist() != [rows, cols]:
            raise ValueError(f"weight_shape {t.tolist()}, expected [{rows}, {cols}]")

    return check
