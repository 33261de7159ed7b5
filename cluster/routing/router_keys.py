"""What the prefix-affinity router hashes: a prompt's routing key, and rendezvous ranks.

The key of a prompt is a hash of its first full KV blocks of token ids (the engine caches only
full blocks). Under a LoRA adapter the same tokens have other K/V, and the engine salts its
block hashes with the adapter's id (`workers.core.block_manager.chain_hash`); the key is
salted the same way, so a prefix cached under one adapter is not credited to another, nor to
the base model.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def prefix_routing_key(
    token_ids: Sequence[int], block_size: int, max_blocks: int, salt: int | None = None
) -> str | None:
    """Hash of the first full KV blocks (at most `max_blocks`), salted with an adapter's id
    (`salt`, None: the base model); None without a full block."""
    full = min(len(token_ids) // block_size, max_blocks)
    if full == 0:
        return None
    h = hashlib.blake2b(array("q", token_ids[: full * block_size]).tobytes(), digest_size=8)
    if salt is not None:
        h.update(b"|lora:%d" % salt)
    return h.hexdigest()


def rendezvous_rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """Replica ids ordered by highest random weight for `key` (first = preferred)."""

    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)
