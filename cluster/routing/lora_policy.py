"""Adapter-aware routing: a LoRA request goes where its adapter is loaded, then by prefix, then
by load (docs/routing.md, "LoRA adapters").

Every engine replica reports the adapters in its device slots (`lora_adapters`, lora_int_ids)
and its free slots (`lora_slots_free`) in its routing stats. For a request under adapter A
(`EngineInput.lora`) the prefix-affinity router ranks the live replicas so:

1. **held**: the replicas holding A that are not saturated (the router's own saturation rule,
   the one that moves a prefix off its preferred replica); among them the prompt's prefix key
   picks one by rendezvous hashing (the key is salted with A's id, as the engine's block
   hashes are), or the least loaded one for a prompt shorter than a block;
2. otherwise the replicas not holding A that are not saturated: those with a free adapter slot
   first (a load there evicts nobody; slots this router filled since the replica's last
   report count as taken), then in A's own rendezvous order, so every router
   sends a cold adapter to the same replica and a hot one spreads to the same next replica
   ("cold" when no replica holds A, "spread" when its holders are saturated);
3. every replica saturated: the least loaded holder (no load at all), else the least loaded.

A holder is a replica whose report names A, or one this router sent an A request to in the
last `hold_s` seconds: reports lag by a routing-stats period, and an engine loads an adapter
only once its request is scheduled, so without this a burst of A's requests would scatter
before any report names a holder.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from cluster.routing.router_keys import rendezvous_rank

LORA_DECISIONS = ("held", "cold", "spread")
DEFAULT_HOLD_S = 5.0
MAX_ADAPTERS = 4096  # adapters whose recent placements a router remembers
MAX_PENDING = 4096  # choices made and not yet routed


def replica_name(replica: Any) -> str:
    return replica.replica_id.unique_id


def reported_adapters(replica: Any) -> tuple[int, ...]:
    return tuple((replica.routing_stats or {}).get("lora_adapters", ()))


def free_slots(replica: Any) -> int:
    """Free adapter slots the replica reported (0 when it said nothing)."""
    return int((replica.routing_stats or {}).get("lora_slots_free", 0))


FreeSlots = Callable[[Any], int]


def adapter_key(lora_id: int) -> str:
    """The rendezvous key of an adapter: where it goes while nobody holds it."""
    return f"lora:{lora_id}"


def rank_for_adapter(
    by_load: Sequence[Any],
    lora_id: int,
    prefix_key: str | None,
    holders: set[str],
    saturated: Callable[[Any], bool],
    free: FreeSlots = free_slots,
) -> tuple[list[Any], str]:
    """(replicas best first, decision: held | cold | spread) for a request under adapter
    `lora_id` (module doc). `by_load`: the live replicas, least loaded first; `free`: a
    replica's free adapter slots."""
    held = [r for r in by_load if replica_name(r) in holders]
    free_held = [r for r in held if not saturated(r)]
    if free_held:
        pick = free_held[0]
        if prefix_key is not None:
            first = rendezvous_rank(prefix_key, [replica_name(r) for r in free_held])[0]
            pick = next(r for r in free_held if replica_name(r) == first)
        decision = "held"
    else:
        others = [r for r in by_load if replica_name(r) not in holders and not saturated(r)]
        if others:
            order = rendezvous_rank(adapter_key(lora_id), [replica_name(r) for r in others])
            position = {name: i for i, name in enumerate(order)}
            pick = min(others, key=lambda r: (free(r) <= 0, position[replica_name(r)]))
            decision = "spread" if held else "cold"
        else:  # every replica saturated: one that need not load the adapter, if any
            pick = held[0] if held else by_load[0]
            decision = "held" if held else "cold"
    # Then holders before the others, each by load (sorted() is stable).
    rest = sorted(
        (r for r in by_load if r is not pick), key=lambda r: replica_name(r) not in holders
    )
    return [pick, *rest], decision


class AdapterPlacements:
    """Where this router sent each adapter's requests lately (module doc), bounded."""

    def __init__(self, hold_s: float = DEFAULT_HOLD_S, max_adapters: int = MAX_ADAPTERS) -> None:
        self._hold_s = hold_s
        self._max = max_adapters
        self._sent: OrderedDict[int, dict[str, float]] = OrderedDict()  # id -> replica: until
        # The same, by replica: what its next reports should add to its slots.
        self._by_replica: dict[str, dict[int, float]] = {}

    def sent(self, lora_id: int, replica: str, now: float) -> None:
        until = self._sent.pop(lora_id, {})
        until[replica] = now + self._hold_s
        self._sent[lora_id] = until
        self._by_replica.setdefault(replica, {})[lora_id] = now + self._hold_s
        while len(self._sent) > self._max:
            old, replicas = self._sent.popitem(last=False)
            for name in replicas:
                self._by_replica.get(name, {}).pop(old, None)

    def recent(self, lora_id: int, now: float) -> set[str]:
        until = self._sent.get(lora_id)
        if not until:
            return set()
        for name in [n for n, t in until.items() if t <= now]:
            del until[name]
        return set(until)

    def unreported(self, replica: str, reported: tuple[int, ...], now: float) -> int:
        """Adapters sent to `replica` lately that its report does not list yet: slots they
        will take (or have taken since it reported)."""
        sent = self._by_replica.get(replica)
        if not sent:
            return 0
        for lora_id in [i for i, t in sent.items() if t <= now]:
            del sent[lora_id]
        return sum(1 for i in sent if i not in reported)


class AdapterRouting:
    """A router's adapter state: recent placements, and each choice until Serve routes it."""

    def __init__(self, hold_s: float = DEFAULT_HOLD_S) -> None:
        self.placements = AdapterPlacements(hold_s)
        # id(pending request) -> (the request, its adapter, the live holders when chosen,
        # the replica ranked first, whether the prompt had a prefix key).
        self._pending: dict[int, tuple[Any, int, frozenset[str], str, bool]] = {}

    def free_slots(self, replica: Any, now: float) -> int:
        """The replica's reported free slots less those this router's recent placements take."""
        taken = self.placements.unreported(replica_name(replica), reported_adapters(replica), now)
        return free_slots(replica) - taken

    def holders(self, replicas: Sequence[Any], lora_id: int, now: float) -> set[str]:
        """The replicas (of `replicas`) that hold the adapter, by report or recent placement."""
        recent = self.placements.recent(lora_id, now)
        return {
            replica_name(r)
            for r in replicas
            if replica_name(r) in recent or lora_id in reported_adapters(r)
        }

    def chosen(
        self, pending: Any, lora_id: int, holders: set[str], first: str = "", keyed: bool = False
    ) -> None:
        self._pending.pop(id(pending), None)
        self._pending[id(pending)] = (pending, lora_id, frozenset(holders), first, keyed)
        while len(self._pending) > MAX_PENDING:
            del self._pending[next(iter(self._pending))]

    def routed(self, pending: Any, replica: str, now: float) -> tuple[str, str] | None:
        """(routing decision, adapter decision) of a routed request, recording where its
        adapter went; None: not an adapter request chosen here. The routing decision is
        `kvray_router_routing_total`'s: the replica ranked first (affinity, or load for a
        prompt without a key) or another (fallback)."""
        choice = self._pending.pop(id(pending), None)
        if choice is None or choice[0] is not pending:
            return None
        _, lora_id, holders, first, keyed = choice
        self.placements.sent(lora_id, replica, now)
        label = ("affinity" if keyed else "load") if replica == first else "fallback"
        if replica in holders:
            return label, "held"
        return label, "spread" if holders else "cold"
