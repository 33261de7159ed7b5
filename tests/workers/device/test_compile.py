"""Shape buckets (workers/compile_sizes.py) and how the engine args carry the compile switch.

CPU only and fast: nothing here compiles (tests/workers/device/test_compile_parity.py does,
once)."""

from __future__ import annotations

import pytest

from workers.compile_sizes import MAX_CAPTURE_SIZE, capture_sizes, padded_size
from workers.config import EngineArgs


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 100, 256, 512, 4096])
def test_every_decode_batch_has_a_bucket_with_bounded_padding(max_num_seqs: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    assert list(sizes) == sorted(set(sizes)) and sizes[0] == 1
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    assert sizes[-1] == top
    assert len(sizes) <= 16  # captures stay a bounded number
    for n in range(1, top + 1):
        bucket = padded_size(n, sizes)
        assert bucket is not None and n <= bucket < 2 * n
        # the smallest bucket that holds n: the one below it does not
        below = [s for s in sizes if s < bucket]
        assert not below or below[-1] < n
    assert padded_size(top + 1, sizes) is None  # larger batches run without a graph


def test_capture_sizes_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_engine_args_carry_the_switch(demo_dir) -> None:
    on = EngineArgs(model=str(demo_dir), compile=True, device="cpu").create_config()
    assert on.compilation.enabled and not on.compilation.cuda_graphs
    every = EngineArgs(model=str(demo_dir), compile=True, compile_min_tokens=1, device="cpu")
    assert every.create_config().compilation.min_tokens == 1
    off = EngineArgs(model=str(demo_dir), device="cpu").create_config()
    assert not off.compilation.enabled
