"""Where an int4 (W4A16) checkpoint's tensors go: a projection's packed weight, scales, zero
points (and GPTQ's g_idx) read into its layer (workers/device/layers/int4_linear.py), this
rank's part of them only, converted to the layer's one in-memory form.

workers/device/loader.py hands each int4 projection here (`int4_targets`); everything else
of the checkpoint it reads itself. Each target checks the whole tensor's shape and dtype
before slicing, so a wrong file is refused with the tensor named (the loader prefixes it),
and refuses a tensor-parallel shard that would cut a packed word or a scale group.

compressed-tensors' pack-quantized layout (the layer's own): `weight_packed` int32
[out, in / 8] (rows or words sliced), `weight_scale` [out, groups], `weight_shape` [2]
(checked, not stored), `weight_zero_point` int32 [out / 8, groups] packed along the rows
(unpacked at load into the layer's uint8 zeros). GPTQ and AWQ: workers/device/
gptq_awq_targets.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from workers.device.layers.int4_linear import PACK, unpack_int4

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class SplitLike(Protocol):
    """The loader's `_Split`: this rank's [start, start + size) of `full` rows or columns."""

    axis: str
    start: int
    size: int
    full: int
    ranks: int


class Int4Target:
    """One checkpoint tensor of an int4 projection: its whole shape (checked), its dtypes,
    what this rank reads of it (`read`: the lazy slice -> a tensor), and the parameter rows
    it fills from `row_offset` (None: a tensor only checked, as `weight_shape`)."""

    def __init__(
        self,
        param: torch.Tensor | None,
        shape: tuple[int, ...],
        dtypes: tuple[torch.dtype, ...],
        read: Callable[[Any], torch.Tensor],
        row_offset: int = 0,
        check: Callable[[torch.Tensor], None] | None = None,
        optional: bool = False,
    ) -> None:
        self.param, self.shape, self.dtypes, self.read = param, shape, dtypes, read
        self.row_offset, self.check = row_offset, check
        self.optional = optional  # the loader does not miss it when a checkpoint lacks it

    def load(self, lazy: Any) -> None:
        shape = tuple(lazy.get_shape())
        if shape != self.shape:
            raise ValueError(f"int4 checkpoint tensor of shape {shape}, expected {self.shape}")
        dtype = _dtype(lazy)
        if dtype not in self.dtypes:
            want = " or ".join(str(d) for d in self.dtypes)
            raise ValueError(f"stored as {dtype}, but an int4 checkpoint stores it as {want}")
        t = self.read(lazy)
        if self.check is not None:
            self.check(t)
        if self.param is None:
            return
        dst = self.param.data[self.row_offset : self.row_offset + t.shape[0]]
        if dst.shape != t.shape:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(t.shape)} vs model {tuple(dst.shape)}"
            )
        dst.copy_(t.to(dst.dtype))


def _dtype(lazy: Any) -> torch.dtype:
    names = {"I32": torch.int32, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
             "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8}  # fmt: skip
    get = getattr(lazy, "get_dtype", None)
    if get is None:  # not a safetensors slice: read it
        return lazy[...].dtype
    return names.get(get(), get())


def check_cut(name: str, split: SplitLike, unit: int | None, what: str) -> None:
    """Refuses a split whose rank's part starts, or ends short of the whole, inside a `unit`
    (a packed word, a scale group; None: nothing to cut)."""
    end = split.start + split.size
    if unit is not None and (split.start % unit or (split.size % unit and end != split.full)):
        raise ValueError(
            f"{name}: tensor_parallel_size ({split.ranks}) gives a rank {split.axis} "
            f"[{split.start}, {end}) of {split.full}, which cuts its int4 {what}"
        )


def part_range(start: int, size: int, unit: int | None, whole: int) -> tuple[int, int]:
    """The units (words, groups) covering [start, start + size): all `whole` of them where
    one unit spans everything (None)."""
    if unit is None:
        return 0, whole
    return start // unit, -(-(start + size) // unit)


def unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero points packed eight per int32 along the rows [ceil(rows / 8), G] -> uint8 [rows, G]."""
    return unpack_int4(packed.t().contiguous(), rows).t().contiguous()


def int4_targets(
    name: str, module: Any, split: SplitLike, part: int | None
) -> dict[str, Int4Target]:
    """Targets of projection `name` (compressed-tensors' names; GPTQ and AWQ through
    workers/device/gptq_awq_targets.py), its fused part `part` (None: not fused), this rank's
    `split`."""
    layout = module.quant.layout
    if layout != "compressed-tensors":
        from workers.device.gptq_awq_targets import gptq_awq_targets

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
            module.weight_scale, (full_rows, groups), _FLOATS, s_read, offset
        ),
        f"{name}.weight_shape": Int4Target(
            None,
            (2,),
            (torch.int64, torch.int32),
            lambda s: s[:],
            check=_shape_is(full_rows, full_cols),
        ),
    }
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
