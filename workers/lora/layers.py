"""The device side of LoRA: every projection's adapter slots, and a step's deltas.

Each LoRA-capable linear layer (the fused qkv and gate_up projections, o_proj, down_proj)
gets a `LoraSlots`: for each of the `max_loras` slots, the adapter's A matrices stacked
([parts * rank, in]) and its B matrices block-diagonal (stored transposed, [parts * rank, out],
already scaled),
the rank packed at the front so a step multiplies by the adapter's own rank, not the cap.
A fused layer's parts (q, k, v) each have their own A and B; stacking them lets one pair of
matmuls serve all parts (the zero blocks of B cost little next to the base GEMM).

A step computes each projection's deltas for all its rows, whatever mix of adapters they run
under, in one of two ways (`LoraSlots.add_to` picks per projection and step, by a cost model):
- masked: x @ A_cat.T over the A of every adapter present in the step (stacked once per set
  of adapters, not per step), a 0/1 mask keeping each row's own adapter's columns (base-model
  rows keep none), then @ B_cat. Four ops whatever the mix, at the price of arithmetic on the
  other adapters' columns: the cheaper way for small steps, few adapters, narrow models;
- per adapter: each adapter's rows gathered, x_rows @ A.T @ B, added back. No wasted
  arithmetic, ~6 ops per adapter present: the cheaper way for large steps with several
  adapters (prefill chunks, wide models).
Neither loops over requests: the batched idea of punica's segmented kernels, on torch's ops
(CUDA, and CPU without the C kernels). On CPU in float32 with the C kernels a third way serves
every step instead: csrc/lora_delta.c, one call per projection that multiplies each row by its
own adapter's A and each fused part's own block of B (no waste, no gathers), over the rows
under an adapter sorted by slot (`LoraBatch.set` sorts them once per step for every layer).

Tensor parallelism: a column-parallel layer's B is sliced like its weight's rows (each rank
its heads / its MLP columns, A whole); a row-parallel layer's A is sliced like its weight's
columns and its delta is added before the all-reduce, which sums the ranks' partial
x_r @ A_r.T into x @ A.T exactly as it sums the base layer's partial products.
"""

from __future__ import annotations

import ctypes

import torch

# (slot, width) of each adapter in a stacked A/B, in column order.
Layout = tuple[tuple[int, int], ...]

# The largest rank of a part csrc/lora_delta.c takes (its MAX_RANK): larger ones keep torch.
LORA_KERNEL_MAX_RANK = 512

# What running each adapter's rows on their own costs, in the multiply-adds the device does in
# that time (`LoraSlots._segmented`): per adapter, the fixed cost of its ~6 ops; per row and
# feature, gathering x and y and copying y back. CPU: fitted to timings of both paths on a
# 2-vCPU Xeon in float32 (hidden 256 to 2,048, 8 to 512 rows, 2 to 8 adapters of rank 16:
# the rule picked the faster path in 35 of 36 cases, the other a tie). CUDA: estimated from
# a launch's ~5 us and memory bandwidth against bfloat16 tensor cores, not yet measured.
SEGMENT_FIXED_MACS = {"cpu": 3e6, "cuda": 3e8}
SEGMENT_GATHER_MACS = {"cpu": 30.0, "cuda": 100.0}


def _rows_by_slot(
    rows: list[tuple[int, int, int]], device: torch.device
) -> dict[int, slice | torch.Tensor]:
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for slot, first, count in rows:
        by_slot.setdefault(slot, []).append((first, first + count))
    out: dict[int, slice | torch.Tensor] = {}
    for slot, ranges in by_slot.items():
        ranges.sort()
        merged = [list(ranges[0])]
        for a, b in ranges[1:]:
            if a == merged[-1][1]:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        if len(merged) == 1:
            out[slot] = slice(merged[0][0], merged[0][1])
        else:
            idx = torch.cat([torch.arange(a, b) for a, b in merged])
            out[slot] = idx.to(device, non_blocking=True)
    return out


class LoraBatch:
    """Which slot each row of the current step runs under: set once per step by the worker,
    read by every `LoraSlots` of the model (shared, like the step's attention metadata)."""

    def __init__(self) -> None:
        self.slots: tuple[int, ...] = ()  # the slots the step uses, ascending
        self._row_slot: torch.Tensor | None = None  # [T] the row's slot, -1: base model
        self._dtype = torch.float32
        self._masks: dict[Layout, torch.Tensor] = {}
        # Each slot's rows: a slice when they are one contiguous run, else their indices.
        self.rows_of: dict[int, slice | torch.Tensor] = {}
        # The rows under an adapter sorted by slot, and their slots (int64, host memory): what
        # the C kernel reads (csrc/lora_delta.c); built on CPU steps only.
        self.sorted_rows: torch.Tensor | None = None
        self.sorted_slots: torch.Tensor | None = None
        self.num_rows = 0
        self.device_kind = "cpu"  # set per step: which cost constants apply

    @property
    def active(self) -> bool:
        return bool(self.slots)

    def set(
        self,
        rows: list[tuple[int, int, int]],
        num_rows: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """`rows`: (slot, first row, count) of each sequence under an adapter this step."""
        row_slot = torch.full((num_rows,), -1, dtype=torch.int32)
        for slot, first, count in rows:
            row_slot[first : first + count] = slot
        self.slots = tuple(sorted({slot for slot, _, _ in rows}))
        self._row_slot = row_slot.to(device, non_blocking=True)
        self._dtype = dtype
        self._masks = {}
        self.num_rows = num_rows
        self.device_kind = "cuda" if device.type == "cuda" else "cpu"
        self.rows_of = _rows_by_slot(rows, device)
        if device.type == "cpu":
            under = torch.nonzero(row_slot >= 0).flatten()
            order = torch.sort(row_slot[under], stable=True)
            self.sorted_rows = under[order.indices].contiguous()
            self.sorted_slots = order.values.to(torch.int64).contiguous()

    def clear(self) -> None:
        self.slots, self._row_slot, self._masks, self.rows_of = (), None, {}, {}
        self.sorted_rows = self.sorted_slots = None

    def mask(self, layout: Layout) -> torch.Tensor:
        """[T, columns] 1 where the column belongs to the row's adapter (shared by every layer
        whose adapters have this layout)."""
        m = self._masks.get(layout)
        if m is None:
            col_slot = torch.tensor([s for s, w in layout for _ in range(w)], dtype=torch.int32)
            col_slot = col_slot.to(self._row_slot.device, non_blocking=True)
            m = (self._row_slot[:, None] == col_slot[None, :]).to(self._dtype)
            self._masks[layout] = m
        return m


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
        # B transposed ([width, out]): a slot's first `width` rows are one contiguous matrix.
        self.b_t = torch.zeros(num_slots, width, sum(out_sizes), dtype=dtype, device=device)
        self.max_rank = max_rank
        self.widths = [0] * num_slots  # the columns of a/b a slot's adapter fills
        # Each slot's rank per part, and the parts' sizes: the C kernel's view of the layout.
        self.ranks = torch.zeros(num_slots, parts, dtype=torch.int64)
        self._out_sizes = torch.tensor(out_sizes, dtype=torch.int64)
        # The CPU kernel library (workers/lora/device.py sets it on CPU float32 engines with
        # the kernels on): every step's deltas then run csrc/lora_delta.c.
        self.lib: ctypes.CDLL | None = None
        # The A and B of the adapters of the latest slot set, stacked (rebuilt when the set
        # changes or a slot is written): (slots, layout, A_cat [cols, in], B_cat [cols, out]).
        self._stacked: tuple[tuple[int, ...], Layout, torch.Tensor, torch.Tensor] | None = None

    def write(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fills `slot` with one (A [r, in], B [out_part, r]) per fused part (None: the adapter
        leaves that part alone), this rank's shard already cut."""
        ranks = [0 if p is None else p[0].shape[0] for p in parts]
        width = sum(ranks)
        a, b_t = self.a[slot], self.b_t[slot]
        a.zero_()
        b_t.zero_()
        col = row = 0
        for part, rank, size in zip(parts, ranks, self.out_sizes, strict=True):
            if part is not None:
                a[col : col + rank].copy_(part[0])
                b_t[col : col + rank, row : row + size].copy_(part[1].T)
            col += rank
            row += size
        self.widths[slot] = width
        self.ranks[slot] = torch.tensor(ranks, dtype=torch.int64)
        self._stacked = None

    def _stack(self, slots: tuple[int, ...]) -> tuple[Layout, torch.Tensor, torch.Tensor]:
        if self._stacked is None or self._stacked[0] != slots:
            layout = tuple((s, self.widths[s]) for s in slots if self.widths[s])
            a = torch.cat([self.a[s, :w] for s, w in layout]) if layout else self.a[0, :0]
            b_t = torch.cat([self.b_t[s, :w] for s, w in layout]) if layout else self.b_t[0, :0]
            self._stacked = (slots, layout, a, b_t)
        return self._stacked[1:]

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the step's deltas: x [T, in], y [T, out] (the base layer's output)."""
        if self.lib is not None and self._kernel(x, y):
            return y
        layout, a, b_t = self._stack(self.batch.slots)
        if not layout:
            return y
        if self._segmented(layout, a.shape[1], b_t.shape[1]):
            return self._add_per_adapter(x, y, layout)
        return y.add_((x @ a.T).mul_(self.batch.mask(layout)) @ b_t)

    def _kernel(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Adds the deltas with csrc/lora_delta.c; False (nothing done) where it does not
        apply: tensors off the host, not float32, or rows not dense."""
        batch = self.batch
        rows, slots = batch.sorted_rows, batch.sorted_slots
        if rows is None or slots is None or x.dtype != torch.float32 or y.dtype != x.dtype:
            return False
        if self.a.dtype != x.dtype or self.max_rank > LORA_KERNEL_MAX_RANK:
            return False
        if x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1:
            return False
        status = self.lib.lora_delta(
            x.data_ptr(),
            x.stride(0),
            y.data_ptr(),
            y.stride(0),
            rows.data_ptr(),
            slots.data_ptr(),
            rows.numel(),
            self.a.data_ptr(),
            self.b_t.data_ptr(),
            self.ranks.data_ptr(),
            self._out_sizes.data_ptr(),
            len(self.out_sizes),
            self.a.shape[2],
            self.b_t.shape[2],
            self.a.shape[1],
            max(1, torch.get_num_threads()),
        )
        if status != 0:
            raise MemoryError("lora_delta: out of memory")
        return True

    def _segmented(self, layout: Layout, n_in: int, n_out: int) -> bool:
        """Whether each adapter's rows should run on their own: when the masked path's wasted
        multiply-adds (every row times the other adapters' columns) exceed what the
        per-adapter path costs over it (its ops, its gathers). Small steps and a single adapter
        stay masked (few ops); large steps with several adapters go per adapter."""
        n = len(layout)
        if n == 1:
            return False
        rows, kind = self.batch.num_rows, self.batch.device_kind
        cols = sum(w for _, w in layout)
        waste = rows * cols * (n - 1) / n * (n_in + n_out)
        cost = n * SEGMENT_FIXED_MACS[kind] + rows * (n_in + 2 * n_out) * SEGMENT_GATHER_MACS[kind]
        return waste > cost

    def _add_per_adapter(self, x: torch.Tensor, y: torch.Tensor, layout: Layout) -> torch.Tensor:
        for slot, w in layout:
            a, b_t = self.a[slot, :w], self.b_t[slot, :w]
            rows = self.batch.rows_of[slot]
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a.T) @ b_t
            else:
                # Not index_add_: on CPU it is ~35x slower than a gather, an add and a copy
                # back (the rows are distinct, so nothing needs accumulating).
                d = (x.index_select(0, rows) @ a.T) @ b_t
                y.index_copy_(0, rows, y.index_select(0, rows) + d)
        return y
