"""The chained block hash that names a full KV block everywhere: the prefix cache, the
host and cluster tiers, KV events and the routers that read them. The same in every process
(blake2b, not Python's `hash`, which varies with the process for None and strings)."""

from __future__ import annotations

import hashlib
from array import array


def chain_hash(parent: int | None, tokens: tuple[int, ...], salt: object = None) -> int:
    """A signed 64-bit hash of (parent hash, token ids, salt), the same in every process."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little", signed=True))
    h.update(array("q", tokens).tobytes())
    if salt is not None:
        h.update(repr(salt).encode())
    return int.from_bytes(h.digest(), "little", signed=True)
