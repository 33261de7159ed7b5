"""What one KV block's bytes are, outside the engine that wrote them: their size (the host
tier's budget) and the layout key a block shared between replicas carries, so a block is
only ever loaded by an engine that lays its KV cache out the same way (the cluster tier,
cluster/replica/kv_share.py). No torch: the core and the replica call these."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.config import EngineConfig

# Bytes read from the end of each weight file for the checkpoint's fingerprint: fine-tunes
# of one base share its config and file sizes, not their last weights.
_TAIL_BYTES = 1 << 16
_BITS = re.compile(r"\d+(?!.*\d)")  # "torch.bfloat16" -> 16: the last number in the name


def kv_block_bytes(config: EngineConfig, tp_size: int) -> int:
    """One KV block's bytes on one rank (K and V, every layer)."""
    m = config.model
    bits = 8 if config.cache.kv_cache_dtype == "fp8" else int(_BITS.search(config.dtype).group())
    kvh = m.kv_heads_per_rank(tp_size)
    return 2 * m.num_layers * config.cache.block_size * kvh * m.head_dim * bits // 8


def checkpoint_fingerprint(model_dir: str) -> str:
    """A short digest of a checkpoint: config.json, and each weight file's name, size and
    last bytes (the whole files would take seconds to hash at every start)."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=8)
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            fh.seek(max(0, size - _TAIL_BYTES))
            h.update(fh.read())
    return h.hexdigest()


def kv_layout_key(config: EngineConfig) -> str:
    """Everything that fixes what a block's bytes mean: the checkpoint, dtype, TP degree,
    block size and the cache's shape per rank. Two engines load each other's blocks only
    when their keys are equal."""
    m, tp = config.model, config.parallel.tensor_parallel_size
    return (
        f"{m.architecture}-{checkpoint_fingerprint(m.path)}|{config.dtype}"
        f"|kv-{config.cache.kv_cache_dtype}|tp{tp}"
        f"|bs{config.cache.block_size}|L{m.num_layers}|kvh{m.kv_heads_per_rank(tp)}"
        f"|hd{m.head_dim}"
    )
