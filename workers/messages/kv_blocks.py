"""A KV block travelling between replicas (the cluster tier): which tokens it holds, the
chained hash that names it, and each tensor-parallel rank's bytes of it.

The exporting engine builds these (workers/core/kv_share.py) and hands them to its caller
with its KV events; the replica publishes them to Ray's object store and a peer's replica
pulls, checks and attaches them to a request (`EngineInput.kv_blocks`), whose engine puts
them in its host tier before scheduling it (cluster/replica/kv_share.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class KvBlockData:
    block_hash: int
    parent_hash: int | None  # the hash block_hash chains on (None: a prompt's first block)
    token_ids: tuple[int, ...]  # the block_size tokens it holds
    salt: int | None  # the adapter id its hash is salted with (None: the base model)
    # Per rank, the block's bytes there ([layers, 2 (K, V), block_size, kv heads, head dim]
    # of the cache's dtype, as uint8): rank r loads shards[r].
    shards: tuple[np.ndarray, ...]

    @property
    def num_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)
