"""The tensor-parallel group a model is built for: rank, size and its two collectives.

Passed explicitly to every parallel layer (no global "context"). With size 1 both
collectives are no-ops, so a TP=1 model runs without torch.distributed at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class CollectiveStats:
    """Wall time spent in collectives (host-side: on CUDA it includes only what blocks)."""

    seconds: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    stats: CollectiveStats = field(default_factory=CollectiveStats, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            t0 = time.perf_counter()
            torch.distributed.all_reduce(x)
            self.stats.seconds += time.perf_counter() - t0
            self.stats.calls += 1
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates each rank's slice along the last dim (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's contiguous slice of `total` items."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})"
            )
        per = total // self.size
        return self.rank * per, per


SINGLE = TPGroup()
