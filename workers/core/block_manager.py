"""The KV block pool: the only writer of block tables.

Blocks are ref-counted. With prefix caching, a full block is identified by a hash chained
over its parent's hash and its token ids (plus an optional salt, e.g. an adapter id), so a
new sequence reuses the longest cached prefix of its prompt. Blocks no sequence references
stay resident in an LRU free queue and are evicted (their hash dropped) only when a block
is needed. With a host tier (workers/core/host_tier.py) an evicted block's contents are kept
in host memory under its hash, and a prompt that misses the device cache past its cached
prefix gets fresh blocks copied back from there (`lookup_host`, `allocate(restore=...)`).

Block hashes are the same in every process (blake2b, not Python's `hash`, which varies with
the process for None and strings): a router hashes a prompt itself and compares with the
engine's KV events (workers/core/kv_events.py), which the manager records when built with
`kv_events=True`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

from workers.core.block_hash import chain_hash
from workers.core.host_tier import HostTier
from workers.core.kv_events import KvEventRecorder
from workers.core.kv_share import KvShare
from workers.core.request import Seq
from workers.kv_layout import kv_block_bytes
from workers.messages.kv_blocks import KvBlockData
from workers.messages.step import KvTransfers

if TYPE_CHECKING:
    from workers.config import EngineConfig


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    tokens: tuple[int, ...] | None = None  # the tokens a hashed block holds (for checks)
    parent_hash: int | None = None  # the hash this block's hash chains on (KV snapshots)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        kv_events: bool = False,
        host_tier: HostTier | None = None,
        share: KvShare | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise kv_cache_memory_bytes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.host_tier = host_tier if enable_caching else None
        # The cluster tier's exports and imports (workers/core/kv_share.py); needs the tier.
        self.share = share if self.host_tier is not None else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks in least-recently-used order (front = evicted first).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        # Hashes dropped from `cached` so far (evictions, resets): until it moves, a block
        # whose hash another block holds cannot be committed.
        self.num_uncached = 0
        self.commit_visits = 0  # blocks commit_full_blocks has looked at, in all
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        # Off unless a KV-aware router listens: no recorder, no cost.
        self.kv_events: KvEventRecorder | None = None
        if kv_events and enable_caching:
            self.kv_events = KvEventRecorder(self._cached_chain, block_size)

    @classmethod
    def for_engine(cls, config: EngineConfig, num_blocks: int) -> BlockManager:
        """The engine's pool of `num_blocks` (as the executor sized the cache), with the host
        tier when kv_offload_gib asks for one."""
        cache, tp = config.cache, config.parallel.tensor_parallel_size
        tier = HostTier.for_engine(config)
        share = (
            KvShare(cache.block_size, tp, kv_block_bytes(config, tp)) if cache.kv_share else None
        )
        return cls(
            num_blocks, cache.block_size, cache.enable_prefix_caching, cache.kv_events, tier, share
        )

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------
    def _hashes(self, seq: Seq, num_full_blocks: int) -> list[int]:
        """Extends seq.block_hashes to cover its first `num_full_blocks` full blocks."""
        bs = self.block_size
        hashes = seq.block_hashes
        toks = seq.token_ids
        # Under an adapter the same tokens have other K/V: its id salts every block's hash.
        salt = None if seq.lora is None else seq.lora.lora_int_id
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(chain_hash(parent, tuple(toks[i * bs : (i + 1) * bs]), salt))
        return hashes

    def lookup_prefix(self, seq: Seq) -> list[int]:
        """Block ids of the longest cached prefix of seq (at least one token left to compute)."""
        if not self.enable_caching or seq.params.needs_every_prompt_position:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for i, h in enumerate(self._hashes(seq, max_blocks)):
            bid = self.cached.get(h)
            if bid is None:
                break
            block = self.blocks[bid]
            # Guard against hash collisions: the block must hold exactly these tokens.
            bs = self.block_size
            if block.tokens != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hit.append(bid)
        return hit

    def lookup_host(self, seq: Seq, start: int) -> list[int]:
        """Hashes of seq's blocks from block `start` on (after its device-cached prefix) that
        the host tier holds: blocks to copy back instead of computing (`allocate`'s restore)."""
        tier = self.host_tier
        if tier is None or seq.params.needs_every_prompt_position:
            return []
        bs = self.block_size
        hit: list[int] = []
        for i, h in enumerate(self._hashes(seq, (seq.num_tokens - 1) // bs)[start:], start):
            # A block the device still holds ends the run: it would be restored twice.
            if h in self.cached or not tier.holds(h, tuple(seq.token_ids[i * bs : (i + 1) * bs])):
                break
            hit.append(h)
        return hit

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(
        self, seq: Seq, num_new_tokens: int, cached: list[int] = (), restore: list[int] = ()
    ) -> bool:
        prefix = len(cached) + len(restore)
        total = seq.num_computed_tokens + prefix * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(seq.block_ids) - len(cached)
        # Cached blocks sitting in the free queue are not free once we take them.
        taken_from_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return need <= self.num_free_blocks - taken_from_free

    def allocate(
        self, seq: Seq, num_new_tokens: int, cached: list[int] = (), restore: list[int] = ()
    ) -> bool:
        """Gives seq blocks for `num_new_tokens` more tokens (after `cached` prefix blocks and
        the `restore` hashes, from `lookup_host`, which get fresh blocks copied back).

        All or nothing: returns False and changes nothing when blocks do not suffice.
        """
        if not self.can_allocate(seq, num_new_tokens, cached, restore):
            return False
        prefix = len(cached) + len(restore)
        total = seq.num_computed_tokens + prefix * self.block_size + num_new_tokens
        # Before the evictions below save blocks to the tier: theirs are the most recent.
        restored = self.host_tier.take(restore) if restore else []
        for bid in cached:
            self._ref(bid)
            seq.block_ids.append(bid)
        need = self.blocks_needed(total) - len(seq.block_ids)
        for k in range(need):
            bid, _ = self.free_queue.popitem(last=False)
            block = self.blocks[bid]
            if block.block_hash is not None:  # evict the LRU cached block
                if self.cached.get(block.block_hash) == bid:
                    del self.cached[block.block_hash]
                    self.num_uncached += 1
                    if self.host_tier is not None:
                        self.host_tier.save(block.block_hash, block.tokens, bid)
                    if self.kv_events is not None:
                        self.kv_events.removed([block.block_hash])
                block.block_hash, block.tokens, block.parent_hash = None, None, None
            block.ref_count = 1
            seq.block_ids.append(bid)
            if k < len(restore):
                self._restore(seq, bid, restore[k], restored[k])
        if restore and self.kv_events is not None:
            self.kv_events.stored(
                list(restore), self.blocks[seq.block_ids[len(cached)]].parent_hash
            )
        return True

    def _restore(self, seq: Seq, bid: int, h: int, tokens: tuple[int, ...]) -> None:
        """Block `bid`, seq's last, gets host-tier hash `h`, copied in before the forward."""
        i = len(seq.block_ids) - 1
        block = self.blocks[bid]
        block.block_hash, block.tokens = h, tokens
        block.parent_hash = seq.block_hashes[i - 1] if i else None
        self.cached[h] = bid
        self.host_tier.load(h, bid)

    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free_queue[bid]
        block.ref_count += 1

    def commit_full_blocks(self, seq: Seq) -> None:
        """Registers the hashes of seq's blocks that are now full of computed tokens.

        A watermark (`Seq.committed_blocks`) keeps a call to the blocks filled since the last
        one: a block below it either has its hash (and keeps it while seq holds it) or is a
        duplicate whose hash another block holds, looked at again only when some hash has
        left the cache since (`num_uncached`), as a walk over every block would find it."""
        if not self.enable_caching:
            return
        # Only tokens whose values are known: a step in flight may have computed past them
        # (async scheduling's pending tokens).
        computed = min(seq.num_computed_tokens, seq.num_tokens)
        full = min(computed // self.block_size, len(seq.block_ids))
        start = min(seq.committed_blocks, full)
        again: list[int] = []
        if seq.duplicate_blocks and seq.duplicates_seen_at != self.num_uncached:
            again, seq.duplicate_blocks = seq.duplicate_blocks, []
        seq.duplicates_seen_at = self.num_uncached
        if start == full and not again:
            return
        hashes = self._hashes(seq, full)
        bs = self.block_size
        stored: list[int] = []  # one run of newly cached, chained blocks (one KV event)
        # Ascending, as a walk from block 0 visits them: the duplicates lie below `start`.
        for i in chain(again, range(start, full)):
            self.commit_visits += 1
            block = self.blocks[seq.block_ids[i]]
            if block.block_hash is not None:
                continue
            h = hashes[i]
            if h in self.cached:  # another block already holds this content
                seq.duplicate_blocks.append(i)
                continue
            block.block_hash = h
            block.parent_hash = hashes[i - 1] if i else None
            block.tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.cached[h] = block.block_id
            if self.share is not None:
                self.share.mark(h, None if seq.lora is None else seq.lora.lora_int_id)
            if self.kv_events is not None:
                if stored and stored[-1] != block.parent_hash:
                    self.kv_events.stored(stored, self.blocks[self.cached[stored[0]]].parent_hash)
                    stored = []
                stored.append(h)
        seq.committed_blocks = full
        if stored and self.kv_events is not None:
            self.kv_events.stored(stored, self.blocks[self.cached[stored[0]]].parent_hash)

    def free(self, seq: Seq) -> None:
        # Tail blocks first, so they are evicted before the (more shareable) prefix blocks.
        for bid in reversed(seq.block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {bid} freed twice")
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Uncached blocks are useless once free: put them first in line.
                    self.free_queue[bid] = None
                    self.free_queue.move_to_end(bid, last=False)
                else:
                    self.free_queue[bid] = None
        seq.block_ids = []
        seq.committed_blocks, seq.duplicate_blocks = 0, []

    def reset_prefix_cache(self) -> None:
        removed: list[int] = []
        for h, bid in list(self.cached.items()):
            if self.blocks[bid].ref_count == 0:
                block = self.blocks[bid]
                block.block_hash, block.tokens, block.parent_hash = None, None, None
                del self.cached[h]
                removed.append(h)
        self.num_uncached += len(removed)
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.kv_events is not None:
            # Blocks in use stay cached: then it is a removal, not a clear.
            if self.cached:
                self.kv_events.removed(removed)
            else:
                self.kv_events.cleared()

    def pop_kv_events(self) -> tuple:
        """This step's KV events (workers/core/kv_events.py); () when nobody asked for them."""
        return self.kv_events.pop() if self.kv_events is not None else ()

    def pop_kv_transfers(self) -> KvTransfers | None:
        """The host tier's copies for the next step (workers/core/host_tier.py) and the
        cluster tier's exports (workers/core/kv_share.py); None: none."""
        if self.host_tier is None:
            return None
        out = self.host_tier.pop_transfers()
        if self.share is not None and (exports := self.share.pop_exports(self.cached, self.blocks)):
            out = out or KvTransfers()
            out.exports = exports
        return out

    def import_blocks(self, blocks: tuple[KvBlockData, ...]) -> int:
        """Blocks pulled from another replica, checked, into the host tier: a prompt that
        continues into them restores them (`lookup_host`). Returns how many entered."""
        return self.share.accept(blocks, self.host_tier) if self.share is not None else 0

    def exported(self, shards: list[dict]) -> None:
        """The ranks' copies of the step's exports (`Executor.take_kv_exports`), handed
        to the caller with the KV events."""
        if self.share is not None and self.kv_events is not None:
            self.kv_events.exported(self.share.collect(shards))

    def _cached_chain(self) -> list[tuple[int, int | None]]:
        """(hash, parent hash) of every cached block: a KV-event snapshot."""
        return [(h, self.blocks[bid].parent_hash) for h, bid in self.cached.items()]

    def check_invariants(self) -> None:
        """Raises AssertionError when internal state is inconsistent (used by tests)."""
        for b in self.blocks:
            assert b.ref_count >= 0, f"negative ref count on block {b.block_id}"
            assert (b.ref_count == 0) == (b.block_id in self.free_queue), (
                f"block {b.block_id}: ref {b.ref_count}, free {b.block_id in self.free_queue}"
            )
        for h, bid in self.cached.items():
            b = self.blocks[bid]
            assert b.block_hash == h and b.tokens is not None and len(b.tokens) == self.block_size
        assert len(self.free_queue) + sum(b.ref_count > 0 for b in self.blocks) == self.num_blocks
        if self.host_tier is not None:
            self.host_tier.check_invariants()
