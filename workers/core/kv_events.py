"""KV events: what enters and leaves an engine's prefix cache, for KV-aware routers.

The block manager reports every full block it registers in its prefix cache (`BlockStored`:
a run of chained block hashes, the hash before the run, the tokens per block), every cached
block it evicts (`BlockRemoved`), and a reset that empties the cache (`AllBlocksCleared`).
The shape follows vLLM's KV events (stored / removed / all-cleared); block hashes are
`workers.core.block_manager.chain_hash`, the same on every process, so a router can hash a
prompt itself and compare.

`KvEventRecorder` collects them between two steps; the engine core pops one batch per step
and ships it with the step's result. It is bounded: when more than `max_pending` events pile
up (nobody popped them), the pending events are dropped and the next pop answers a snapshot
instead (`AllBlocksCleared` then one `BlockStored` per cached block), so a reader never
applies a stream with a hole in it. Recording is off unless the engine was built with
`kv_events=True` (a router asked for it): the block manager then holds no recorder at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from workers.messages.kv_blocks import KvBlockData


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now in the prefix cache: block_hashes[i] chains on block_hashes[i-1], the first
    on `parent_hash` (None: the first block of a prompt)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    block_size: int  # tokens per block (only full blocks are cached)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache is empty (a reset, or the start of a snapshot)."""


@dataclass(frozen=True, slots=True)
class BlocksExported:
    """Blocks the engine copied out for the cluster tier (`CacheConfig.kv_share`): not a
    change of the prefix cache, so a router's mirror ignores it; the replica publishes
    them (cluster/replica/kv_share.py)."""

    blocks: tuple[KvBlockData, ...]


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | BlocksExported

DEFAULT_MAX_PENDING = 65536


class KvEventRecorder:
    """Pending KV events of one engine, popped once per step. Not thread-safe: the engine's
    own thread (or process) records and pops."""

    def __init__(
        self,
        snapshot: Callable[[], Iterable[tuple[int, int | None]]],
        block_size: int,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        # snapshot(): (hash, parent hash) of every cached block, for a resync after overflow.
        self._snapshot = snapshot
        self._block_size = block_size
        self._max_pending = max_pending
        self._pending: list[KvEvent] = []
        self._num_pending_blocks = 0
        self._overflowed = False
        self.num_dropped = 0  # events dropped by overflows (each overflow answers a snapshot)

    def stored(self, block_hashes: list[int], parent_hash: int | None) -> None:
        if block_hashes:
            self._add(
                BlockStored(tuple(block_hashes), parent_hash, self._block_size), len(block_hashes)
            )

    def removed(self, block_hashes: list[int]) -> None:
        if block_hashes:
            self._add(BlockRemoved(tuple(block_hashes)), len(block_hashes))

    def exported(self, blocks: list[KvBlockData]) -> None:
        if blocks:
            self._add(BlocksExported(tuple(blocks)), len(blocks))

    def cleared(self) -> None:
        # Everything before a clear no longer matters to a reader.
        self.num_dropped += len(self._pending)
        self._pending = [AllBlocksCleared()]
        self._num_pending_blocks = 1
        self._overflowed = False

    def pop(self) -> tuple[KvEvent, ...]:
        """The events since the last pop, in order (a snapshot after an overflow)."""
        if self._overflowed:
            self._overflowed = False
            return (AllBlocksCleared(), *self._snapshot_events())
        events = tuple(self._pending)
        self._pending = []
        self._num_pending_blocks = 0
        return events

    def _add(self, event: KvEvent, blocks: int) -> None:
        if self._overflowed:
            self.num_dropped += 1
            return
        self._pending.append(event)
        self._num_pending_blocks += blocks
        if self._num_pending_blocks > self._max_pending:
            # Drop them all: the next pop sends the cache's whole state instead.
            self.num_dropped += len(self._pending)
            self._pending = []
            self._num_pending_blocks = 0
            self._overflowed = True

    def _snapshot_events(self) -> list[KvEvent]:
        return [BlockStored((h,), parent, self._block_size) for h, parent in self._snapshot()]
