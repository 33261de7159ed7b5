"""The chained block hash that names a full KV block everywhere: the prefix cache, the
host and cluster tiers, KV events and the routers that read them. The same in every process
(blake2b, not Python's `hash`, which varies with the process for None and strings)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_hash(parent: int | None, tokens: tuple[int, ...], salt: object = None) -> int:
    """A signed 64-bit hash of (parent hash, token ids, salt), the same in every process."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little", signed=True))
    h.update(array("q", tokens).tobytes())
    if salt is not None:
        h.update(repr(salt).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int, salt: int | None = None
) -> list[int]:
    """The chained hashes of the prompt's full blocks the engine could reuse (it always
    computes the last token), at most `max_blocks`: the engine's own hashes (`salt`: the
    request's LoRA adapter id, None for the base model)."""
    n = min((len(token_ids) - 1) // block_size, max_blocks)
    hashes: list[int] = []
    parent = None
    for i in range(n):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = chain_hash(parent, block, salt)
        hashes.append(parent)
    return hashes
