"""A projection's adapter deltas (workers/lora/layers.py) against a row-by-row reference,
through the three ways of computing them (masked, per adapter, the CPU kernel) and the rule
between the first two; the kernel's work does not grow with the adapters in a batch."""

from __future__ import annotations

import pytest
import torch

from workers.device.layers.cpu_kernels import kernel
from workers.lora import layers
from workers.lora.layers import LoraBatch, LoraSlots

CPU = torch.device("cpu")
OUTS = [24, 8, 8]  # a fused projection's parts (q, k, v)
HIDDEN = 16


def _slots(ranks: dict[int, list[int | None]]) -> tuple[LoraBatch, LoraSlots, dict]:
    """Slots filled with random adapters: slot -> rank per part (None: the part untouched)."""
    gen = torch.Generator().manual_seed(0)
    batch = LoraBatch()
    s = LoraSlots(batch, 4, HIDDEN, OUTS, 8, torch.float32, CPU)
    written = {}
    for slot, per_part in ranks.items():
        parts = [
            None
            if r is None
            else (torch.randn(r, HIDDEN, generator=gen), torch.randn(o, r, generator=gen))
            for r, o in zip(per_part, OUTS, strict=True)
        ]
        s.write(slot, parts)
        written[slot] = parts
    return batch, s, written


def _reference(x: torch.Tensor, row_slot: list[int], written: dict) -> torch.Tensor:
    out = torch.zeros(x.shape[0], sum(OUTS), dtype=torch.float64)
    for t, slot in enumerate(row_slot):
        if slot < 0:
            continue
        cols = []
        for part, o in zip(written[slot], OUTS, strict=True):
            cols.append(
                torch.zeros(o, dtype=torch.float64)
                if part is None
                else part[1].double() @ (part[0].double() @ x[t].double())
            )
        out[t] = torch.cat(cols)
    return out


def _lib():
    lib = kernel()
    if lib is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    return lib


@pytest.mark.parametrize("path", ["masked", "per_adapter", "chosen", "kernel"])
def test_deltas_match_a_row_by_row_reference(path: str, monkeypatch) -> None:
    batch, s, written = _slots({0: [4, 4, 4], 2: [8, None, 2], 3: [1, 1, 1]})
    # Rows: base, slot 2, slot 0 (two runs: a gather), slot 3, base, slot 0, then slot 3's
    # prefill of 6 rows (more than the kernel's tile of 4 rows).
    row_slot = [-1, 2, 2, 0, 0, 3, -1, 0, 3, 3, 3, 3, 3, 3]
    seqs = [(2, 1, 2), (0, 3, 2), (3, 5, 1), (0, 7, 1), (3, 8, 6)]
    batch.set(seqs, len(row_slot), CPU, torch.float32)
    if path == "kernel":
        s.lib = _lib()
    elif path == "masked":
        monkeypatch.setattr(s, "_segmented", lambda *a: False)
    elif path == "per_adapter":
        monkeypatch.setattr(s, "_segmented", lambda *a: True)
    x = torch.randn(len(row_slot), HIDDEN, generator=torch.Generator().manual_seed(1))
    base = torch.randn(len(row_slot), sum(OUTS), generator=torch.Generator().manual_seed(2))
    y = s.add_to(x, base.clone())
    torch.testing.assert_close(
        y.double() - base.double(), _reference(x, row_slot, written), rtol=1e-5, atol=1e-5
    )


def test_the_rule_keeps_small_steps_masked_and_goes_per_adapter_for_large_ones(monkeypatch) -> None:
    batch, s, _ = _slots({0: [8, 8, 8], 1: [8, 8, 8], 2: [8, 8, 8], 3: [8, 8, 8]})
    batch.set([(i % 4, i, 1) for i in range(8)], 8, CPU, torch.float32)
    assert not s._segmented(s._stack(batch.slots)[0], HIDDEN, sum(OUTS))
    batch.set([(i % 4, i * 512, 512) for i in range(4)], 2048, CPU, torch.float32)
    monkeypatch.setattr(layers, "SEGMENT_FIXED_MACS", {"cpu": 0.0, "cuda": 0.0})
    assert s._segmented(s._stack(batch.slots)[0], HIDDEN, sum(OUTS))
    batch.set([(1, 0, 2048)], 2048, CPU, torch.float32)  # one adapter: nothing is wasted
    assert not s._segmented(s._stack(batch.slots)[0], HIDDEN, sum(OUTS))


def _ops_of_add_to(num_adapters: int) -> list[str]:
    """The torch ops one projection's `add_to` runs, the kernel serving, for a decode step of
    16 rows spread over `num_adapters` adapters."""
    batch, s, _ = _slots({slot: [4, 4, 4] for slot in range(num_adapters)})
    s.lib = _lib()
    batch.set([(i % num_adapters, i, 1) for i in range(16)], 16, CPU, torch.float32)
    x, y = torch.randn(16, HIDDEN), torch.zeros(16, sum(OUTS))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        s.add_to(x, y)
    assert y.abs().sum() > 0  # the deltas were added
    return [e.name for e in prof.events()]


def test_the_kernel_runs_one_call_whatever_the_adapters() -> None:
    """A regression to torch's ops shows as matmuls, gathers and masks, whose number or size
    grows with the adapters in the batch: with the kernel there are none."""
    for n in (1, 4):
        ops = _ops_of_add_to(n)
        assert not [op for op in ops if op.startswith("aten::")], (n, ops)
