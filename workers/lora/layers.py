"""The device side of LoRA: every projection's adapter slots, and a step's deltas.

Each LoRA-capable linear layer (the fused qkv and gate_up projections, o_proj, down_proj)
gets a `LoraSlots`: for each of the `max_loras` slots, the adapter's A matrices stacked
([parts * rank, in]) and its B matrices block-diagonal ([out, parts * rank], already scaled),
the rank packed at the front so a step multiplies by the adapter's own rank, not the cap.
A fused layer's parts (q, k, v) each have their own A and B; stacking them lets one pair of
matmuls serve all parts (the zero blocks of B cost little next to the base GEMM).

A step's rows are grouped by slot (`LoraBatch.set`): for each adapter present, one
x[rows] @ A.T @ B.T over all of that adapter's rows in the step — decodes and prefill
chunks of every request under it together — added to the base layer's output. The work is
a loop over the step's adapters (at most `max_loras`), never over requests: the segmented
("SGMV") shape of the computation, on torch's ops (CPU and CUDA alike).

Tensor parallelism: a column-parallel layer's B is sliced like its weight's rows (each rank
its heads / its MLP columns, A whole); a row-parallel layer's A is sliced like its weight's
columns and its delta is added before the all-reduce, which sums the ranks' partial
x_r @ A_r.T into x @ A.T exactly as it sums the base layer's partial products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Segment:
    slot: int
    start: int  # rows start..stop, when the slot's rows are one contiguous range
    stop: int
    rows: torch.Tensor | None  # else their indices


class LoraBatch:
    """Which rows of the current step run under which slot: set once per step by the worker,
    read by every `LoraSlots` of the model (shared, like the step's attention metadata)."""

    def __init__(self) -> None:
        self.segments: list[_Segment] = []

    @property
    def active(self) -> bool:
        return bool(self.segments)

    def set(self, rows: list[tuple[int, int, int]], device: torch.device) -> None:
        """`rows`: (slot, first row, count) of each sequence under an adapter this step."""
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, first, count in rows:
            by_slot.setdefault(slot, []).append((first, first + count))
        segments = []
        for slot, ranges in by_slot.items():
            ranges.sort()
            merged = [list(ranges[0])]
            for a, b in ranges[1:]:
                if a == merged[-1][1]:
                    merged[-1][1] = b
                else:
                    merged.append([a, b])
            if len(merged) == 1:
                segments.append(_Segment(slot, merged[0][0], merged[0][1], None))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in merged]).to(device)
                segments.append(_Segment(slot, 0, 0, idx))
        self.segments = segments

    def clear(self) -> None:
        self.segments = []


class LoraSlots:
    """One linear layer's adapter slots (module doc). Not an nn.Module: the model's module
    walks (kernel set-up, compiling, weight loading) must not see it."""

    def __init__(
        self,
        batch: LoraBatch,
        num_slots: int,
        in_features: int,
        out_sizes: list[int],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.out_sizes = out_sizes  # this rank's rows of each fused part
        parts = len(out_sizes)
        width = parts * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, sum(out_sizes), width, dtype=dtype, device=device)
        self.widths = [0] * num_slots  # the columns of a/b a slot's adapter fills

    def write(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fills `slot` with one (A [r, in], B [out_part, r]) per fused part (None: the adapter
        leaves that part alone), this rank's shard already cut."""
        ranks = [0 if p is None else p[0].shape[0] for p in parts]
        width = sum(ranks)
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        col = row = 0
        for part, rank, size in zip(parts, ranks, self.out_sizes, strict=True):
            if part is not None:
                a[col : col + rank].copy_(part[0])
                b[row : row + size, col : col + rank].copy_(part[1])
            col += rank
            row += size
        self.widths[slot] = width

    def clear(self, slot: int) -> None:
        self.widths[slot] = 0

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the step's deltas: x [T, in], y [T, out] (the base layer's output)."""
        for seg in self.batch.segments:
            w = self.widths[seg.slot]
            if not w:
                continue
            a, b = self.a[seg.slot, :w], self.b[seg.slot, :, :w]
            if seg.rows is None:
                xs = x[seg.start : seg.stop]
                y[seg.start : seg.stop] += (xs @ a.T) @ b.T
            else:
                y.index_add_(0, seg.rows, (x.index_select(0, seg.rows) @ a.T) @ b.T)
        return y
