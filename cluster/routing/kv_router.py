"""KV-event request router: send a prompt where its KV blocks really are, weighed against load.

Every replica's engine reports the blocks entering and leaving its prefix cache (KV events,
workers/core/kv_events.py); the replica publishes them in its routing stats
(cluster/replica/kv_publish.py) and Serve broadcasts those to every router, so each router
instance (one per ingress replica) keeps its own `KvIndex` (cluster/routing/kv_index.py).

Per request the router hashes the prompt's full blocks exactly as the engine does
(`workers.core.block_manager.chain_hash`, salted with the request's LoRA adapter id, if any),
asks the index how many leading blocks each live replica holds, and picks the lowest cost:

    cost = tokens to prefill (prompt minus the held prefix)
           (with the cluster KV tier, `kv_share`: the blocks a peer holds past that prefix
           count pull_token_cost each instead of 1: it pulls them, dearer than holding them,
           cheaper than computing them; so a hot prefix spreads to a second replica by
           pulling once its holder's load outweighs the difference)
         + load_tokens x (requests in flight + engine waiting queue)
         + the prompt tokens waiting there (a queue of long prompts is longer than one of
           short ones: what sets a prefill replica's delay)
         + the whole prompt again when the replica's KV cache is nearly full
         + adapter_load_tokens when the request's adapter is not loaded there
         - home_tokens for the prompt's rendezvous "home" replica, if it holds as much as any

With the defaults a replica holding the adapter is worth 4 requests in flight (the
prefix-affinity router's imbalance threshold): past that its adapter's requests spread.

Replicas whose waiting queue is full are passed over while another has room, as
PrefixAffinityRouter does (`routable`). Replicas that left the deployment drop out of the
index on the next request; a new replica (or a restarted engine: another epoch) starts empty.
Requests with an explicit routing key, and non-generate calls, are routed like
PrefixAffinityRouter does (rendezvous on the key).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from cluster.messages import GenerateRequest
from cluster.ray_internals import ask_for_backoff
from cluster.routing.kv_index import DEFAULT_MAX_BLOCKS, DEFAULT_PREDICTED_TTL_S, KvIndex
from cluster.routing.lora_policy import DEFAULT_HOLD_S, AdapterRouting
from cluster.routing.router import (
    PrefixAffinityRouter,
    RouterOptions,
    prefix_routing_key,
    rendezvous_rank,
)
from workers.core.block_hash import prompt_block_hashes

KV_ROUTER_CLASS_PATH = "cluster.routing.kv_router.KvEventsRouter"
MAX_PENDING_CHOICES = 4096  # requests chosen for and not yet routed, remembered for predict()


@dataclass(frozen=True)
class KvRouterOptions:
    """The KV router's `request_router_kwargs` (cluster/deploy/app.py passes them from
    ServeConfig)."""

    block_size: int  # the engine's KV block size
    max_prompt_blocks: int = 256  # leading blocks hashed per prompt (bounds the lookup cost)
    load_tokens: float = 128.0  # prefill tokens one more request in flight is worth
    # Credit of the prompt's home replica (rendezvous on its first blocks, the old rule) when
    # it holds as much of the prompt as any: a prefix nobody holds (new, or evicted
    # everywhere) goes back to the same replica instead of wherever load put it last.
    home_tokens: float = 256.0
    home_key_blocks: int = 4
    kv_cache_usage_limit: float = 0.95  # at/above: a hit will likely be evicted; no credit
    max_index_blocks: int = DEFAULT_MAX_BLOCKS  # per replica
    predicted_ttl_s: float = DEFAULT_PREDICTED_TTL_S
    # A LoRA request on a replica without its adapter: the load, and the eviction it may cause.
    adapter_load_tokens: float = 512.0
    adapter_hold_s: float = DEFAULT_HOLD_S  # a replica sent an adapter holds it this long
    # The cluster KV tier is on (--kv-share-gib): what a peer holds, a replica can pull.
    kv_share: bool = False
    # A pulled token's cost, in computed tokens (the pull's bytes against the prefill; the
    # replica's own cost model makes the real choice, cluster/replica/kv_cost.py).
    pull_token_cost: float = 0.25

    @staticmethod
    def from_kwargs(kwargs: dict[str, Any]) -> KvRouterOptions:
        known = {f.name for f in fields(KvRouterOptions)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown KvEventsRouter kwargs: {sorted(unknown)}")
        if "block_size" not in kwargs:
            raise ValueError("KvEventsRouter needs request_router_kwargs['block_size']")
        return KvRouterOptions(**kwargs)


class KvEventsRouter(PrefixAffinityRouter):
    """Scores replicas by the prompt blocks their engines report holding, against load."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._kv_opts = KvRouterOptions.from_kwargs(kwargs)
        # The fallback path (explicit routing keys) is PrefixAffinityRouter's.
        self._opts = RouterOptions(block_size=self._kv_opts.block_size)
        self.index = KvIndex(
            max_blocks=self._kv_opts.max_index_blocks,
            predicted_ttl_s=self._kv_opts.predicted_ttl_s,
        )
        # id(request) -> (request, its block hashes, label) until it is routed; bounded.
        self._choices: dict[int, tuple[PendingRequest, list[int], str]] = {}
        self._adapters = AdapterRouting(self._kv_opts.adapter_hold_s)
        self.decisions = 0
        self.cpu_s = 0.0  # this router's CPU time spent choosing (thread time)
        self._metrics = _router_metrics()

    def refresh(self, replicas: Sequence[RunningReplica]) -> None:
        """Feed the index every known replica's latest payload; forget replicas that left."""
        every = {r.replica_id.unique_id: r for r in self.curr_replicas.values()}
        every.update((r.replica_id.unique_id, r) for r in replicas)
        self.index.retain(every)
        for rid, r in every.items():
            self.index.update(rid, (r.routing_stats or {}).get("kv"))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = pending_request.args[0] if pending_request and pending_request.args else None
        if not isinstance(request, GenerateRequest) or request.routing_key:
            return await super().choose_replicas(candidate_replicas, pending_request)
        if not candidate_replicas:
            return []
        started = time.thread_time()
        ask_for_backoff(pending_request)  # type: ignore[arg-type]
        self.remember_request(pending_request)
        self.refresh(candidate_replicas)
        replicas = self.routable(candidate_replicas, pending_request)
        opts = self._kv_opts
        ids = request.input.prompt_token_ids
        lora = request.input.lora
        salt = None if lora is None else lora.lora_int_id
        now = time.monotonic()
        holders = set() if salt is None else self._adapters.holders(replicas, salt, now)
        hashes, held, pullable = self.prompt_blocks(replicas, ids, salt, now)
        most = max(held.values())
        home = self._home(ids, replicas, salt)
        scored = []
        for r in random.sample(replicas, len(replicas)):  # ties: no favourite
            rid = r.replica_id.unique_id
            cost = self.cost(r, len(ids), held[rid], pullable[rid])
            if salt is not None and rid not in holders:
                cost += opts.adapter_load_tokens
            if r is home and held[rid] == most:
                cost -= opts.home_tokens
            scored.append((cost, -held[rid], r))
        scored.sort(key=lambda t: t[:2])
        best_held = -scored[0][1]
        label = "load" if not any(t[1] for t in scored) else "affinity"
        if label == "affinity" and best_held < max(-t[1] for t in scored):
            label = "fallback"  # a replica holds more, but load outweighs it
        self._choices.pop(id(pending_request), None)
        self._choices[id(pending_request)] = (pending_request, hashes, label)  # type: ignore[assignment]
        while len(self._choices) > MAX_PENDING_CHOICES:
            del self._choices[next(iter(self._choices))]
        self.decisions += 1
        self.cpu_s += time.thread_time() - started
        ranked = [t[2] for t in scored]
        if salt is not None:
            self._adapters.chosen(pending_request, salt, holders)
        return [[ranked[0]], ranked[1:3]] if len(ranked) > 1 else [ranked]

    def prompt_blocks(
        self, replicas: Sequence[RunningReplica], ids: Sequence[int], salt: int | None, now: float
    ) -> tuple[list[int], dict[str, int], dict[str, int]]:
        """A prompt's block hashes, and per replica id the leading blocks it holds and the
        blocks past those a peer holds, which it would pull (none without the cluster tier).
        Disaggregation's estimate reads them too (cluster/routing/replica_loads.py)."""
        opts = self._kv_opts
        hashes = prompt_block_hashes(ids, opts.block_size, opts.max_prompt_blocks, salt)
        held = {
            r.replica_id.unique_id: self.index.overlap(r.replica_id.unique_id, hashes, now)
            for r in replicas
        }
        most = max(held.values(), default=0)
        pullable = {rid: most - n if opts.kv_share else 0 for rid, n in held.items()}
        return hashes, held, pullable

    def _home(
        self, ids: Sequence[int], replicas: list[RunningReplica], salt: int | None
    ) -> RunningReplica | None:
        opts = self._kv_opts
        key = prefix_routing_key(ids, opts.block_size, opts.home_key_blocks, salt)
        if key is None:
            return None
        by_id = {r.replica_id.unique_id: r for r in replicas}
        return by_id[rendezvous_rank(key, list(by_id))[0]]

    def cost(
        self, replica: RunningReplica, prompt_tokens: int, held_blocks: int, pullable: int = 0
    ) -> float:
        """`pullable`: blocks past the held ones that a peer holds (the cluster KV tier)."""
        opts = self._kv_opts
        stats = replica.routing_stats or {}
        miss = prompt_tokens - (held_blocks + pullable) * opts.block_size
        miss += pullable * opts.block_size * opts.pull_token_cost
        if float(stats.get("kv_cache_usage", 0.0)) >= opts.kv_cache_usage_limit:
            miss += prompt_tokens
        load = self._in_flight(replica) + int(stats.get("waiting", 0))
        return miss + opts.load_tokens * load + int(stats.get("queued_tokens", 0))

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        choice = self._choices.pop(id(pending_request), None)
        if choice is None or choice[0] is not pending_request:  # routed by an explicit key
            super().on_request_routed(pending_request, replica_id, result)
            return
        _, hashes, label = choice
        now = time.monotonic()
        self.index.predict(replica_id.unique_id, hashes, now)
        self._metrics.routing(label)
        adapter = self._adapters.routed(pending_request, replica_id.unique_id, now)
        if adapter is not None:
            self._metrics.lora_routing(adapter[1])


def _router_metrics() -> Any:
    from cluster.routing.metrics import RouterMetrics

    return RouterMetrics()
