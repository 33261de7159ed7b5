"""Shape buckets of the compiled forward pass: the decode batch sizes CUDA graphs are
captured for, and the bucket a batch is padded up to (workers/device/compile.py uses them).

Torch-free, so the config (workers/config.py) can size the buckets at the edge.
"""

from __future__ import annotations

import bisect

# Decode batch sizes CUDA graphs are captured for: fine steps for small batches (where a
# padded row costs most, relatively), at most 1.5x padding above 4.
MAX_CAPTURE_SIZE = 512
_CAPTURE_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """The decode batch sizes to capture: the ladder up to max_num_seqs (a decode-only batch
    has at most that many tokens), with max_num_seqs itself as the last size when it falls
    between two rungs, so every decode batch up to min(max_num_seqs, limit) has a graph."""
    top = min(max_num_seqs, limit)
    if top < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in _CAPTURE_LADDER if s <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


# CPU: steps of fewer tokens than this run the eager forward even with --compile. Measured
# per forward of the pieces (docs/benchmarks.md, "Compiled forward on CPU"), eager /
# compiled, 2 threads:
# with OMP_WAIT_POLICY=PASSIVE (what a host shared with other work wants) every parallel op
# of the compiled pieces pays a thread wake-up that small steps do not earn back -- demo
# model 0.62x at 1 token, 0.89x at 96, 1.03x at 128, 1.4-1.5x from 192 up; 100M checkpoint
# 0.76x at 1, 0.88x at 32, 1.2x from 64 up. With libgomp's default spin the compiled pieces
# win at every size (demo 1.24-1.70x, 100M 1.04-1.12x), yet end to end 0 and 128 measured
# the same. 128 loses nothing either way.
CPU_COMPILED_MIN_TOKENS = 128


def padded_size(num_tokens: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest capture size holding `num_tokens`, or None when it is larger than all."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None
