"""The engine's side of the cluster KV tier (`CacheConfig.kv_share`): which full blocks it
copies out for other replicas, and the checks on blocks other replicas copied out.

Export: every block the prefix cache registers from computed tokens (prompt and output
blocks alike: a conversation's next turn, or a migrated request, continues from both) is
marked once; the next step's transfers copy it to the host on every rank (before that
step's forward, so it still holds what the step that filled it wrote), the executor hands
the copies over, and they leave with the KV events (`BlocksExported`) for the replica to
publish. Blocks copied back from the host tier are not exported again; a block evicted
before its copy is skipped.

Import: blocks a replica pulled (`EngineInput.kv_blocks`) enter the host tier, whose
restore path then copies them into the device cache as the request is scheduled. Each is
checked first: its hash must chain over its parent, tokens and adapter salt
(`chain_hash`), and its shards must be one per rank of this engine's block size in bytes;
a block that fails is refused (counted), never loaded.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from workers.core.block_hash import chain_hash
from workers.messages.kv_blocks import KvBlockData

if TYPE_CHECKING:
    from workers.core.block_manager import Block
    from workers.core.host_tier import HostTier

log = logging.getLogger(__name__)

# Hashes exported lately, not marked again while they are remembered (a prefix that is
# computed again after an eviction would otherwise be published again and again).
DEFAULT_REMEMBER = 1 << 16


class KvShare:
    def __init__(
        self, block_size: int, tp: int, shard_bytes: int, remember: int = DEFAULT_REMEMBER
    ):
        self.block_size = block_size
        self.tp = tp
        self.shard_bytes = shard_bytes  # one block on one rank
        self._remember = remember
        self._exported: OrderedDict[int, None] = OrderedDict()
        self._marked: list[tuple[int, int | None]] = []  # (hash, salt), not yet copied
        # The copies of the step in flight: hash -> (parent, tokens, salt).
        self.in_flight: dict[int, tuple[int | None, tuple[int, ...], int | None]] = {}
        self.exported = 0  # blocks handed over (cumulative)
        self.imported = 0  # pulled blocks that entered the host tier (cumulative)
        self.refused = 0  # pulled blocks that failed a check (cumulative)

    def mark(self, block_hash: int, salt: int | None) -> None:
        """A block just registered from computed tokens: export it with the next step."""
        if block_hash in self._exported:
            self._exported.move_to_end(block_hash)
            return
        self._exported[block_hash] = None
        if len(self._exported) > self._remember:
            self._exported.popitem(last=False)
        self._marked.append((block_hash, salt))

    def pop_exports(self, cached: dict[int, int], blocks: list[Block]) -> list[tuple[int, int]]:
        """(hash, block id) of the marked blocks the device still holds, for this step."""
        out: list[tuple[int, int]] = []
        for h, salt in self._marked:
            bid = cached.get(h)
            if bid is None:
                self._exported.pop(h, None)  # gone before its copy: export it next time
                continue
            b = blocks[bid]
            self.in_flight[h] = (b.parent_hash, b.tokens, salt)
            out.append((h, bid))
        self._marked = []
        return out

    def collect(self, shards: list[dict]) -> list[KvBlockData]:
        """The step's exports, from each rank's copies (`Executor.take_kv_exports`)."""
        out = []
        for h, (parent, tokens, salt) in self.in_flight.items():
            per_rank = tuple(s.get(h) for s in shards)
            if all(p is not None for p in per_rank):
                out.append(KvBlockData(h, parent, tokens, salt, per_rank))
        self.in_flight = {}
        self.exported += len(out)
        return out

    def accept(self, blocks: tuple[KvBlockData, ...], tier: HostTier) -> int:
        """Puts checked pulled blocks into the host tier; returns how many entered."""
        entered = 0
        for b in blocks:
            why = None
            if len(b.token_ids) != self.block_size:
                why = f"{len(b.token_ids)} tokens, not {self.block_size}"
            elif len(b.shards) != self.tp or any(s.nbytes != self.shard_bytes for s in b.shards):
                why = "its shards do not match this engine's ranks or block bytes"
            elif chain_hash(b.parent_hash, b.token_ids, b.salt) != b.block_hash:
                why = "its hash does not chain over its parent, tokens and salt"
            if why is not None:
                self.refused += 1
                log.warning("refused a pulled KV block %x: %s", b.block_hash & (2**64 - 1), why)
                continue
            entered += tier.insert(b.block_hash, b.token_ids, b.shards)
        self.imported += entered
        return entered
