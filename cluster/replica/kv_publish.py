"""The replica's side of KV-event routing: the engine's KV events, published to every router.

Transport: Ray Serve's routing stats (no new broker). The controller calls
`LLMServer.record_routing_stats` every period and broadcasts the result to every
DeploymentHandle's router, so each router (one per ingress replica) sees every replica's
payload. A router only ever sees the latest payload, and may miss some (a slow long poll
coalesces), so each payload carries:

- `epoch`: new for every LLMServer (and engine): a router that sees another epoch for a
  replica drops what it knew about it;
- `seq`: the number of the last event published (events are numbered 1, 2, ...);
- `log`: the events of the last `LOG_PUBLISHES` publishes as (first seq, events) batches,
  so a router that missed a broadcast or two still applies a gapless stream;
- `snapshot`: every `SNAPSHOT_EVERY`-th publish (and the first), (seq, every cached block
  hash): a new router, or one that found a gap, starts over from it.

Events are encoded small for the wire: ("s", hashes) stored, ("r", hashes) removed, ("c",)
cleared. The mirror of cached hashes is bounded by the engine's cache (plus `max_blocks`).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

from workers.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlocksExported,
    BlockStored,
    KvEvent,
)

if TYPE_CHECKING:
    from cluster.config import ServeConfig
    from workers.frontend.async_engine import AsyncEngine

LOG_PUBLISHES = 4
SNAPSHOT_EVERY = 5
DEFAULT_MAX_BLOCKS = 1 << 20

Wire = tuple[Any, ...]


def encode(event: KvEvent) -> Wire:
    if isinstance(event, BlockStored):
        return ("s", event.block_hashes)
    if isinstance(event, BlockRemoved):
        return ("r", event.block_hashes)
    return ("c",)


class KvPublisher:
    """Engine KV events in (any thread), routing-stats payloads out. Thread-safe."""

    def __init__(
        self,
        epoch: str | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        log_publishes: int = LOG_PUBLISHES,
        snapshot_every: int = SNAPSHOT_EVERY,
    ) -> None:
        self.epoch = epoch or uuid.uuid4().hex
        self._max_blocks = max_blocks
        self._snapshot_every = snapshot_every
        self._lock = threading.Lock()
        self._mirror: dict[int, None] = {}  # cached hashes, oldest first
        self._seq = 0
        self._pending: list[Wire] = []
        self._pending_first = 1
        self._log: deque[tuple[int, tuple[Wire, ...]]] = deque(maxlen=log_publishes)
        self._publishes = 0

    def on_events(self, events: tuple[KvEvent, ...]) -> None:
        """The engine's listener (AsyncEngine.kv_listener): called on its core's thread."""
        with self._lock:
            for ev in events:
                if isinstance(ev, BlocksExported):  # the cluster tier's (kv_share.py)
                    continue
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        self._mirror[h] = None
                    while len(self._mirror) > self._max_blocks:
                        del self._mirror[next(iter(self._mirror))]
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        self._mirror.pop(h, None)
                elif isinstance(ev, AllBlocksCleared):
                    self._mirror.clear()
                if not self._pending:
                    self._pending_first = self._seq + 1
                self._pending.append(encode(ev))
                self._seq += 1

    def publish(self) -> dict[str, Any]:
        """The `kv` entry of this replica's routing stats."""
        with self._lock:
            if self._pending:
                self._log.append((self._pending_first, tuple(self._pending)))
                self._pending = []
            snapshot = None
            if self._publishes % self._snapshot_every == 0:
                snapshot = (self._seq, tuple(self._mirror))
            self._publishes += 1
            return {
                "epoch": self.epoch,
                "seq": self._seq,
                "log": tuple(self._log),
                "snapshot": snapshot,
            }

    @property
    def num_blocks(self) -> int:
        return len(self._mirror)


def kv_publisher(config: ServeConfig, engine: AsyncEngine) -> KvPublisher | None:
    """The replica's publisher, listening to its engine; None unless the router reads it."""
    if config.replicas.request_router != "kv_events":
        return None
    publisher = KvPublisher()
    engine.kv_listener = publisher.on_events
    return publisher
