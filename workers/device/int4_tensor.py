"""One int4 checkpoint tensor's target and the checks its tensor-parallel slicing shares:
used by workers/device/int4_targets.py (compressed-tensors) and
workers/device/gptq_awq_targets.py (GPTQ, AWQ). Each target checks the whole tensor's shape
and dtype before slicing, so a wrong file is refused with the tensor named (the loader
prefixes it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from workers.device.layers.int4_linear import unpack_int4

FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes scales are stored in


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
