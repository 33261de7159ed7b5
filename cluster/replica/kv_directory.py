"""The cluster KV tier's directory: which KV blocks the application's replicas published to
Ray's object store, and the objects themselves, owned here.

    directory = directory_actor(app_name)      # created by the first replica, then found
    directory.publish.remote(layout, [(hash, [ref], nbytes), ...])
    refs = await directory.lookup.remote(layout, hashes)   # the published run from hashes[0]

One detached actor per application (named `kv-directory/<app>` in the `kvray` namespace, on
the head node, like the LoRA registry). It holds the last reference to every published
block; each block is owned by its node's store actor (cluster/replica/kv_store.py), so it
survives the replica that computed it as long as its node lives (a dead node's blocks are
lost: the puller then recomputes).

The store is bounded: `capacity_bytes` (`--kv-share-gib`, at most half the smallest node's
object store) over every published block, least recently used (published or looked up)
dropped first. Dropping the last reference frees the object; a peer in the middle of
reading one keeps it until it is done (its borrowed reference). Blocks are keyed by (layout
key, hash): an engine with another checkpoint, dtype, TP degree or block size
(`workers.kv_layout.kv_layout_key`) never sees them.

Restarts (`max_restarts=-1`) come back empty: the old references died with it, and
replicas publish again as they compute. `kvray serve` removes it and the store actors when
it stops (`delete_directory`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from cluster.head_actor import head_actor, kill_head_actor

logger = logging.getLogger("ray.serve.kvray.kv_share")

NAME_PREFIX = "kv-directory/"
# The share of the smallest node's object store the tier may fill: one node's replicas can
# publish every block of the application, and the rest of the store is for Ray's and Serve's
# own objects. Past its budget the tier drops blocks (peers recompute); an object store pushed
# past its memory would spill to disk instead, and every pull would read the disk.
STORE_SHARE = 0.5


class KvDirectory:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        # (layout, hash) -> (ObjectRef, bytes), least recently used first.
        self._blocks: OrderedDict[tuple[str, int], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self.published = 0  # blocks accepted (cumulative)
        self.evicted = 0  # blocks dropped for room (cumulative)

    def publish(self, layout: str, entries: list[tuple[int, list[Any], int]]) -> int:
        """Takes published blocks: (hash, [ObjectRef], bytes) each (the ref in a list, so Ray
        hands the reference over instead of the object). Returns how many are new."""
        new = 0
        for block_hash, (ref,), nbytes in entries:
            key = (layout, block_hash)
            if key in self._blocks:
                self._blocks.move_to_end(key)  # the same tokens: the object already here serves
                continue
            if nbytes > self.capacity_bytes:
                continue
            self._blocks[key] = (ref, nbytes)
            self._bytes += nbytes
            new += 1
        self.published += new
        while self._bytes > self.capacity_bytes:
            _, (_, nbytes) = self._blocks.popitem(last=False)  # its object is freed with it
            self._bytes -= nbytes
            self.evicted += 1
        return new

    def lookup(self, layout: str, hashes: list[int]) -> list[list[Any]]:
        """The published blocks of the run that starts at hashes[0], in order, up to the first
        one missing: [[ref], ...] (each ref in a list, as `publish` takes them)."""
        out = []
        for h in hashes:
            entry = self._blocks.get((layout, h))
            if entry is None:
                break
            self._blocks.move_to_end((layout, h))
            out.append([entry[0]])
        return out

    def stats(self) -> dict[str, int]:
        return {
            "blocks": len(self._blocks),
            "bytes": self._bytes,
            "capacity_bytes": self.capacity_bytes,
            "published": self.published,
            "evicted": self.evicted,
        }

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0


def directory_name(app_name: str) -> str:
    return NAME_PREFIX + app_name


def directory_actor(app_name: str, capacity_bytes: int) -> Any:
    """The application's directory, created if it does not exist yet (the first replica's
    capacity sizes it, within `tier_capacity`: every replica of one application has the
    same)."""
    return head_actor(KvDirectory, directory_name(app_name), tier_capacity(capacity_bytes))


def tier_capacity(requested: int) -> int:
    """`requested`, or STORE_SHARE of the smallest live node's object store if less."""
    import ray

    stores = [int(n["Resources"].get("object_store_memory", 0)) for n in ray.nodes() if n["Alive"]]
    room = int(STORE_SHARE * min(stores)) if stores else requested
    if requested > room:
        logger.warning(
            "cluster KV tier: %.2f GiB asked for, %.2f GiB used: half of the smallest node's "
            "object store (a larger tier would spill it to disk)",
            requested / (1 << 30),
            room / (1 << 30),
        )
    return min(requested, room)


def delete_directory(app_name: str) -> bool:
    """Kills the application's directory and its nodes' store actors (the objects are freed
    with them); whether there was a directory."""
    from cluster.replica.kv_store import delete_stores

    delete_stores(app_name)
    return kill_head_actor(directory_name(app_name))
