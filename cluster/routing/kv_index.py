"""Which replica holds which KV blocks: the index a KV-event router scores replicas with.

Fed by the replicas' routing-stats payloads (cluster/replica/kv_publish.py), one per replica,
in whatever order they arrive: a payload older than what the index has applied is ignored,
events are applied once each by their sequence number, a gap (missed payloads) empties the
replica's entry until its next snapshot, and another epoch (a restarted replica or engine)
starts the replica over. Replicas not in the current set are dropped at once (`retain`); a
new replica starts empty.

Besides what the engines report, the router records where it just sent a prompt
(`predict`): those blocks will be there within a step, but the next report is up to a
routing-stats period away. Predictions expire after `predicted_ttl_s`.

Memory: hashes only (8-byte ints in dicts), at most `max_blocks` reported and
`max_predicted` predicted per replica, oldest evicted first. No Ray here: unit-testable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_BLOCKS = 1 << 20
DEFAULT_MAX_PREDICTED = 1 << 16
DEFAULT_PREDICTED_TTL_S = 5.0


@dataclass
class ReplicaKv:
    epoch: str | None = None
    seq: int | None = None  # last event applied; None: not in sync (waits for a snapshot)
    blocks: dict[int, None] = field(default_factory=dict)  # reported hashes, oldest first
    predicted: dict[int, float] = field(default_factory=dict)  # hash -> expiry time


class KvIndex:
    def __init__(
        self,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        max_predicted: int = DEFAULT_MAX_PREDICTED,
        predicted_ttl_s: float = DEFAULT_PREDICTED_TTL_S,
    ) -> None:
        self.max_blocks = max_blocks
        self.max_predicted = max_predicted
        self.predicted_ttl_s = predicted_ttl_s
        self.replicas: dict[str, ReplicaKv] = {}
        self.resyncs = 0  # gaps found (each waits for a snapshot)

    # -- feeding ---------------------------------------------------------------------------
    def update(self, replica_id: str, payload: dict[str, Any] | None) -> None:
        """Apply one routing-stats `kv` payload of `replica_id` (None: nothing yet)."""
        if not payload:
            return
        rep = self.replicas.get(replica_id)
        if rep is None or rep.epoch != payload["epoch"]:
            rep = self.replicas[replica_id] = ReplicaKv(epoch=payload["epoch"])
        if rep.seq is not None and payload["seq"] <= rep.seq:
            return  # stale or duplicate
        if rep.seq is not None and not self._apply_log(rep, payload["log"]):
            self.resyncs += 1
            rep.seq = None
            rep.blocks.clear()
        if rep.seq is None:
            snapshot = payload.get("snapshot")
            if snapshot is None:
                return  # wait for one
            rep.blocks = dict.fromkeys(snapshot[1])
            rep.seq = snapshot[0]
            self._apply_log(rep, payload["log"])
        self._bound(rep.blocks, self.max_blocks)

    def _apply_log(self, rep: ReplicaKv, log: Sequence[tuple[int, Sequence[Any]]]) -> bool:
        """Applies the events after rep.seq; False (nothing applied) on a gap."""
        assert rep.seq is not None
        first = next((start for start, events in log if start + len(events) - 1 > rep.seq), None)
        if first is None:
            return True  # nothing new
        if first > rep.seq + 1:
            return False
        blocks = rep.blocks
        for start, events in log:
            for i, ev in enumerate(events):
                if start + i <= rep.seq:
                    continue
                kind = ev[0]
                if kind == "s":
                    for h in ev[1]:
                        blocks[h] = None
                        rep.predicted.pop(h, None)  # confirmed
                elif kind == "r":
                    for h in ev[1]:
                        blocks.pop(h, None)
                else:
                    blocks.clear()
                rep.seq = start + i
        return True

    def predict(self, replica_id: str, hashes: Iterable[int], now: float) -> None:
        """The router sent a prompt with these leading block hashes to `replica_id`."""
        rep = self.replicas.setdefault(replica_id, ReplicaKv())
        expiry = now + self.predicted_ttl_s
        for h in hashes:
            if h not in rep.blocks:
                rep.predicted.pop(h, None)  # re-insert: newest last
                rep.predicted[h] = expiry
        pred = rep.predicted
        while pred and (len(pred) > self.max_predicted or next(iter(pred.values())) < now):
            del pred[next(iter(pred))]

    # -- membership ------------------------------------------------------------------------
    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in `replica_ids` (gone: dead, replaced, scaled down)."""
        keep = set(replica_ids)
        for rid in [r for r in self.replicas if r not in keep]:
            del self.replicas[rid]

    # -- queries ---------------------------------------------------------------------------
    def overlap(self, replica_id: str, hashes: Sequence[int], now: float) -> int:
        """How many of `hashes` (a prompt's chained block hashes), from the first, the
        replica holds or was just sent."""
        rep = self.replicas.get(replica_id)
        if rep is None:
            return 0
        blocks, pred = rep.blocks, rep.predicted
        n = 0
        for h in hashes:
            if h in blocks:
                n += 1
                continue
            expiry = pred.get(h)
            if expiry is None or expiry < now:
                break
            n += 1
        return n

    def num_blocks(self, replica_id: str | None = None) -> int:
        """Hashes held (reported + predicted), for one replica or all."""
        reps = self.replicas.values() if replica_id is None else [self.replicas.get(replica_id)]
        return sum(len(r.blocks) + len(r.predicted) for r in reps if r is not None)

    @staticmethod
    def _bound(d: dict[int, Any], cap: int) -> None:
        while len(d) > cap:
            del d[next(iter(d))]
