"""Prefix-affinity request router for LLMServer: send shared prefixes where they are cached.

The key of a request is a hash of its prompt's first full KV blocks of token ids (up to
`max_blocks` blocks of `block_size` tokens): requests that share those blocks share prefix-cache
entries, so they should meet on one replica. The key picks a preferred replica by rendezvous
(highest-random-weight) hashing over the replicas' ids, so every router instance (each
ingress replica has its own) agrees without talking, and adding or removing a replica only
moves the keys that belonged to it.

Load comes from two places: this router's own count of requests in flight per replica (Ray
Serve's queue-length cache, exact for this router) and the replicas' routing stats (engine
waiting queue, KV usage; refreshed every `ROUTING_STATS_PERIOD_S` by the controller). When the
preferred replica is saturated, or far busier than the least-loaded one, the request goes to
the least-loaded replica instead ("fallback"). Requests without a key (prompts shorter than a
block) go to the least-loaded replica ("load").

What the router reads: the first argument of the handle call. Ingresses tokenize, so an
`LLMServer.generate` call carries a `cluster.messages.GenerateRequest` with token ids
(an explicit `routing_key` overrides the hash); `replica_stats({"routing_key": K})` carries
a dict. The block size is the engine's (`request_router_kwargs["block_size"]`, from
ServeConfig via cluster/deploy/app.py). Serve internals the router needs are in ray_internals.py.

Replicas whose routing stats say `engine_alive: False` are left out while any other is alive.
So are replicas whose waiting queue is at their `max_queued_requests` cap (they answer 429)
while another has room; the queue is estimated from this router's in-flight count, which moves
with every request it sends, less the engine's running count of the last stats (`_has_room`).
A request still refused for a full queue (another ingress's router filled it meanwhile) is
sent again to another replica by the ingress (cluster/ingress/migration.py).

A request under a LoRA adapter (`EngineInput.lora`) goes first where its adapter is loaded,
then by prefix (its key salted with the adapter's id), then by load; when the adapter's
holders are saturated it spreads to others, which then load it (cluster/routing/lora_policy.py).

A request a Kubernetes inference gateway sent to one pod (`GenerateRequest.prefer_node_id`,
the Ray node of the pod its endpoint picker chose: cluster/http/gateway_hint.py) goes to a
replica on that node while one there is below its `max_ongoing_requests`, chosen among them by
the rules here; else it is routed as any other. The picker has weighed the pods' load and
caches already, so its choice wins over this router's own prefix guess.

`--request-router kv_events` (cluster/routing/kv_router.py) routes on what the engines report
holding instead of this guess; it keeps this rule as its tie-break ("home" replica) and for
calls with an explicit routing key.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.messages import GenerateRequest
from cluster.ray_internals import FulfillOwnRequest, ask_for_backoff
from cluster.routing.lora_policy import DEFAULT_HOLD_S, AdapterRouting, rank_for_adapter
from cluster.routing.router_keys import prefix_routing_key, rendezvous_rank

__all__ = ["PrefixAffinityRouter", "RouterOptions", "prefix_routing_key", "rendezvous_rank"]

logger = logging.getLogger("ray.serve.kvray.router")

ROUTER_CLASS_PATH = "cluster.routing.router.PrefixAffinityRouter"
ROUTING_STATS_PERIOD_S = 1.0


@dataclass(frozen=True)
class RouterOptions:
    """The router's `request_router_kwargs` (cluster/deploy/app.py passes them from ServeConfig)."""

    block_size: int  # the engine's KV block size: only full blocks are prefix-cached
    max_blocks: int = 4  # key = hash of the first min(full blocks, max_blocks) blocks
    imbalance_threshold: int = 4  # in-flight(preferred) - in-flight(least loaded) from: fallback
    kv_cache_usage_limit: float = 0.95  # preferred replica's KV usage at/above: fallback
    adapter_hold_s: float = DEFAULT_HOLD_S  # a replica sent an adapter holds it this long

    @staticmethod
    def from_kwargs(kwargs: dict[str, Any]) -> RouterOptions:
        known = {f.name for f in fields(RouterOptions)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown PrefixAffinityRouter kwargs: {sorted(unknown)}")
        if "block_size" not in kwargs:
            raise ValueError(
                "PrefixAffinityRouter needs request_router_kwargs['block_size'] "
                "(the engine's KV block size)"
            )
        return RouterOptions(**kwargs)


def request_routing_key(request: Any, opts: RouterOptions) -> str | None:
    """The routing key of a handle call's first argument (None: route by load only).

    A GenerateRequest (LLMServer.generate): its explicit key, else the hash of its prompt's
    first full blocks (salted with its LoRA adapter's id, as the engine's block hashes are).
    A dict (`replica_stats({"routing_key": K})`): its explicit key.
    """
    if isinstance(request, GenerateRequest):
        if request.routing_key:
            return request.routing_key
        lora = request.input.lora
        return prefix_routing_key(
            request.input.prompt_token_ids,
            opts.block_size,
            opts.max_blocks,
            salt=None if lora is None else lora.lora_int_id,
        )
    if isinstance(request, dict):
        explicit = request.get("routing_key")
        return explicit if isinstance(explicit, str) and explicit else None
    return None


def live_replicas(
    replicas: list[RunningReplica], pending_request: PendingRequest | None = None
) -> list[RunningReplica]:
    """The replicas whose last routing stats do not say their engine is dead, less those a
    migrated request already failed on (its `exclude_replicas`).

    A dead engine fails requests at once, so it would look least loaded and draw traffic
    until Serve's health check replaces it. Replicas without stats yet count as alive. If
    every replica is dead they are all kept: requests then fail fast with the engine-dead
    error instead of waiting for a replica that may never come.
    """
    alive = [r for r in replicas if (r.routing_stats or {}).get("engine_alive", True)]
    request = pending_request.args[0] if pending_request and pending_request.args else None
    avoid = getattr(request, "exclude_replicas", None)
    if avoid:
        alive = [r for r in alive if r.replica_id.unique_id not in avoid] or alive
    return alive or replicas


class PrefixAffinityRouter(FulfillOwnRequest, RequestRouter):
    """Prefix-cache affinity balanced against load. Configured through request_router_kwargs.

    FulfillOwnRequest: the replica chosen for a request goes to that request, even when
    several handle calls share one ingress request's id (see ray_internals).
    """

    # An engine replica's event loop shares its process with the engine thread, so a
    # queue-length probe can take longer than Serve's 0.1 s default on a busy CPU machine;
    # a missed deadline makes the router treat the replica as unavailable for that round.
    queue_len_response_deadline_s = 0.5
    max_queue_len_response_deadline_s = 5.0

    def initialize_state(self, **kwargs: Any) -> None:
        # Serve calls this right after constructing the router, before any routing.
        self._opts = RouterOptions.from_kwargs(kwargs)
        self._metrics = _router_metrics()
        self._adapters = AdapterRouting(self._opts.adapter_hold_s)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            ask_for_backoff(pending_request)
            self.remember_request(pending_request)
        request = pending_request.args[0] if pending_request and pending_request.args else None
        if isinstance(request, dict):
            # replica_stats({"routing_key": K}): K's replica, however busy; that is how a
            # caller reaches each replica (a busy one is the one it wants to see).
            preferred = self._preferred(live_replicas(candidate_replicas), pending_request)
            if preferred is not None:
                return [[preferred]]
        candidate_replicas = self.routable(candidate_replicas, pending_request)
        # Shuffled first so that equally loaded replicas share the work (sort is stable).
        by_load = sorted(random.sample(candidate_replicas, len(candidate_replicas)), key=self._load)
        if isinstance(request, GenerateRequest) and request.input.lora is not None:
            return self._choose_for_adapter(by_load, request, pending_request)
        preferred = self._preferred(candidate_replicas, pending_request)
        if preferred is None:
            # Ray Serve picks the least loaded within a rank (probing if its cache is cold).
            return [by_load[:2]]
        others = [r for r in by_load if r.replica_id != preferred.replica_id]
        if self._saturated(preferred, by_load[0]):
            return [others[:2], [preferred]] if others else [[preferred]]
        return [[preferred], others[:2]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        adapter = self._adapters.routed(pending_request, replica_id.unique_id, time.monotonic())
        if adapter is not None:
            self._metrics.routing(adapter[0])
            self._metrics.lora_routing(adapter[1])
            return
        self._metrics.routing(self.routing_decision(pending_request, replica_id))

    def routing_decision(self, pending_request: PendingRequest, replica_id: ReplicaID) -> str:
        """A routed request's `decision` label (monitoring/README.md): affinity|load|fallback."""
        preferred = self._preferred(
            live_replicas(list(self.curr_replicas.values()), pending_request), pending_request
        )
        if preferred is None:
            return "load"
        return "affinity" if preferred.replica_id == replica_id else "fallback"

    def routable(
        self, replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[RunningReplica]:
        """The live replicas (`live_replicas`) with room in their waiting queue; all the live
        ones when none has room (the request then waits in Serve's queue or gets its 429).
        Of those, only the ones on the request's preferred node when any there is below its
        max_ongoing_requests (`on_preferred_node`)."""
        alive = live_replicas(replicas, pending_request)
        roomy = [r for r in alive if self._has_room(r)] or alive
        return self.on_preferred_node(roomy, pending_request) or roomy

    def on_preferred_node(
        self, replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[RunningReplica]:
        """The `replicas` on the node the request prefers (`prefer_node_id`) that are below
        their max_ongoing_requests; [] when it prefers none, or none there can take it."""
        request = pending_request.args[0] if pending_request and pending_request.args else None
        node = getattr(request, "prefer_node_id", None)
        if not node:
            return []
        return [
            r for r in replicas if r.node_id == node and self._in_flight(r) < r.max_ongoing_requests
        ]

    # -- internals -----------------------------------------------------------------------

    def _choose_for_adapter(
        self,
        by_load: list[RunningReplica],
        request: GenerateRequest,
        pending_request: PendingRequest | None,
    ) -> list[list[RunningReplica]]:
        """A LoRA request: its adapter's holders, then prefix, then load (lora_policy.py)."""
        lora_id = request.input.lora.lora_int_id  # type: ignore[union-attr]
        key = request_routing_key(request, self._opts)
        now = time.monotonic()
        adapters = self._adapters
        holders = adapters.holders(by_load, lora_id, now)
        ranked, _ = rank_for_adapter(
            by_load,
            lora_id,
            key,
            holders,
            lambda r: self._saturated(r, by_load[0]),
            lambda r: adapters.free_slots(r, now),
        )
        if pending_request is not None:
            first = ranked[0].replica_id.unique_id
            self._adapters.chosen(pending_request, lora_id, holders, first, key is not None)
        return [[ranked[0]], ranked[1:3]] if len(ranked) > 1 else [ranked]

    def _preferred(
        self, replicas: Sequence[RunningReplica], pending_request: PendingRequest | None
    ) -> RunningReplica | None:
        if pending_request is None or not replicas:
            return None
        request = pending_request.args[0] if pending_request.args else None
        key = request_routing_key(request, self._opts)
        if key is None:
            return None
        by_id = {r.replica_id.unique_id: r for r in replicas}
        return by_id[rendezvous_rank(key, list(by_id))[0]]

    def _in_flight(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        if cached is not None:
            return cached
        stats = replica.routing_stats or {}
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0))

    def _queued(self, replica: RunningReplica) -> int:
        """The replica's waiting queue as this router can tell it now: its in-flight count
        (Serve's queue-length cache, which counts each request this router sends the moment it
        goes, and is set to the replica's own count on each reply) less what its engine ran at
        the last stats. The replica's `queued` is up to one stats period old: a burst fills a
        queue well before the next stats show it."""
        stats = replica.routing_stats or {}
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        if cached is None:
            return int(stats.get("queued", 0))
        return max(0, cached - int(stats.get("running", 0)))

    def _has_room(self, replica: RunningReplica) -> bool:
        """Below its `max_queued_requests` (a replica at it answers 429 QueueFullError)."""
        cap = int((replica.routing_stats or {}).get("max_queued_requests", 0))
        return not cap or self._queued(replica) < cap

    def _load(self, replica: RunningReplica) -> tuple[int, float]:
        stats = replica.routing_stats or {}
        return (self._in_flight(replica), float(stats.get("kv_cache_usage", 0.0)))

    def _saturated(self, preferred: RunningReplica, least: RunningReplica) -> bool:
        opts = self._opts
        stats = preferred.routing_stats or {}
        if int(stats.get("waiting", 0)) > 0:
            return True  # the engine itself has no room: it is queueing
        cap = int(stats.get("max_queued_requests", 0))
        if cap and self._queued(preferred) * 2 >= cap:
            return True  # half way to rejecting with 429
        token_cap = int(stats.get("max_queued_tokens", 0))
        if token_cap and int(stats.get("queued_tokens", 0)) * 2 >= token_cap:
            return True  # half way to rejecting with 429 for its waiting prompt tokens
        if float(stats.get("kv_cache_usage", 0.0)) >= opts.kv_cache_usage_limit:
            return True
        if self._in_flight(preferred) >= preferred.max_ongoing_requests:
            return True
        return self._in_flight(preferred) - self._in_flight(least) >= opts.imbalance_threshold


def _router_metrics() -> Any:
    from cluster.routing.metrics import RouterMetrics

    return RouterMetrics()
