"""The host-memory KV tier's bookkeeping, on the engine's side: which block hashes the
workers' host pools hold, least recently used first, bounded by bytes, and the copies the
next step must make (`workers.messages.step.KvTransfers`).

The block manager (workers/core/block_manager.py) calls `save` when it evicts a full, hashed
block from the device cache, and `take` + `load` when a new sequence's prompt continues past
its device-cached prefix into hashes held here (the blocks are copied back instead of
recomputed). A block's hash chains over its prefix and the adapter salt, so an entry is only
ever served for the same tokens under the same adapter. A restored block stays in the tier
too (inclusive): when the device evicts it again, nothing needs copying.

The contents live in each rank's pool (workers/device/kv_offload.py, its own shard of every
block), which applies a step's transfers before the forward: all saves (reading the device
blocks as earlier steps left them), then all loads, then all drops. The bookkeeping keeps that
grouped order equivalent to the order the block manager asked in:
- a hash dropped in the step that loads it is still in the pool when the load reads it;
- a save of a hash dropped earlier in the same step cancels that drop (the save rewrites it),
  and so does an import (`insert`: a block pulled from another replica, cluster tier);
- a block loaded this step is never saved in the same step (the save would read the block
  before its load): it is not, as a restored block belongs to a running sequence all step,
  and `save` skips it should that ever change (the contents are merely not kept).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from workers.kv_layout import kv_block_bytes
from workers.messages.step import KvTransfers

if TYPE_CHECKING:
    from workers.config import EngineConfig

GIB = 1 << 30


class HostTier:
    def __init__(self, capacity_bytes: int, block_bytes: int, block_size: int) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.block_bytes = block_bytes  # one block, every layer, K and V, all ranks
        self.block_size = block_size
        self.capacity_blocks = max(0, capacity_bytes) // block_bytes
        # hash -> the tokens the block holds (a collision guard, as the device cache's),
        # least recently used first.
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._pending = KvTransfers()
        self._pending_drops: set[int] = set()
        self._loaded_blocks: set[int] = set()  # block ids the pending loads write
        self._loaded_hashes: set[int] = set()  # and the hashes they read
        self.copies_out = 0  # blocks saved to the host (cumulative)
        self.copies_in = 0  # blocks restored to the device (cumulative)
        self.evictions = 0  # blocks dropped to make room (cumulative)
        self.hit_tokens = 0  # tokens restored instead of recomputed (cumulative)
        self.imports = 0  # blocks pulled from other replicas (cumulative)

    @classmethod
    def for_engine(cls, config: EngineConfig) -> HostTier | None:
        """The engine's tier: kv_offload_gib GiB over all its ranks' pools; None when off (0,
        too small for a block, or no prefix caching: blocks without hashes)."""
        cache, tp = config.cache, config.parallel.tensor_parallel_size
        if not cache.enable_prefix_caching:
            return None
        tier = cls(
            int(cache.kv_offload_gib * GIB), kv_block_bytes(config, tp) * tp, cache.block_size
        )
        return tier if tier.capacity_blocks > 0 else None

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.entries)

    @property
    def num_bytes(self) -> int:
        return len(self.entries) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    def holds(self, block_hash: int, tokens: tuple[int, ...]) -> bool:
        """Whether `block_hash` is here holding `tokens` (a collision guard, as the device's)."""
        return self.entries.get(block_hash) == tokens

    # -- changes ---------------------------------------------------------------------------
    def save(self, block_hash: int, tokens: tuple[int, ...], block_id: int) -> None:
        """Keeps an evicted device block's contents (copied before the next forward)."""
        if self.capacity_blocks == 0:
            return
        if block_id in self._loaded_blocks or block_hash in self._loaded_hashes:
            return  # restored this step: its save would read it before the load (module doc)
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)  # the same contents are already here
            return
        self._enter(block_hash, tokens)
        self._pending.saves.append((block_hash, block_id))
        self.copies_out += 1

    def insert(self, block_hash: int, tokens: tuple[int, ...], shards: tuple) -> bool:
        """Takes a block pulled from another replica (its ranks' bytes, `shards`), put into
        the pools before the next forward; False when it is here already (or no room)."""
        if self.capacity_blocks == 0 or block_hash in self.entries:
            return False
        self._enter(block_hash, tokens)
        self._pending.imports.append((block_hash, shards))
        self.imports += 1
        return True

    def _enter(self, block_hash: int, tokens: tuple[int, ...]) -> None:
        """A new entry, the least recently used dropped for room; its save or import (the
        caller's) rewrites the pool's copy, so a drop of it pending this step is cancelled."""
        while len(self.entries) >= self.capacity_blocks:
            old, _ = self.entries.popitem(last=False)
            self._pending.drops.append(old)
            self._pending_drops.add(old)
            self.evictions += 1
        if block_hash in self._pending_drops:
            self._pending_drops.discard(block_hash)
            self._pending.drops.remove(block_hash)
        self.entries[block_hash] = tokens

    def take(self, hashes: list[int]) -> list[tuple[int, ...]]:
        """Their tokens, for hashes (found by `holds`) about to be restored; each then gets a
        `load`. They stay, as the most recently used."""
        for h in hashes:
            self.entries.move_to_end(h)
        return [self.entries[h] for h in hashes]

    def load(self, block_hash: int, block_id: int) -> None:
        """Copies a taken hash's contents into device block `block_id` before the forward."""
        self._pending.loads.append((block_hash, block_id))
        self._loaded_blocks.add(block_id)
        self._loaded_hashes.add(block_hash)
        self.copies_in += 1
        self.hit_tokens += self.block_size

    def clear(self) -> None:
        """Forgets every entry (the prefix cache's reset)."""
        for h in self.entries:
            self._pending.drops.append(h)
            self._pending_drops.add(h)
        self.entries.clear()

    def pop_transfers(self) -> KvTransfers | None:
        """The copies asked since the last call, for the next step (None: none)."""
        out = self._pending
        self._pending = KvTransfers()
        self._pending_drops.clear()
        self._loaded_blocks.clear()
        self._loaded_hashes.clear()
        return out if out else None

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent (used by tests)."""
        assert len(self.entries) <= self.capacity_blocks, "host tier over its capacity"
        for h, tokens in self.entries.items():
            assert len(tokens) == self.block_size, f"host tier entry {h} is not a full block"
            assert h not in self._pending_drops, f"host tier entry {h} is being dropped"
        loads = [h for h, _ in self._pending.loads]
        assert len(set(loads)) == len(loads), "a hash loaded twice in one step"
        assert set(loads) <= self.entries.keys() | self._pending_drops, "a load of nothing"
        assert self._pending_drops == set(self._pending.drops)
