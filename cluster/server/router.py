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
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from array import array
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

logger = logging.getLogger("ray.serve.kvray.router")

ROUTER_CLASS_PATH = "cluster.server.router.PrefixAffinityRouter"
ROUTING_STATS_PERIOD_S = 1.0

DEFAULTS: dict[str, Any] = {
    "block_size": 16,  # the engine's KV block size: only full blocks are prefix-cached
    "max_blocks": 4,  # key = hash of the first min(full blocks, max_blocks) blocks
    "imbalance_threshold": 4,  # in-flight(preferred) - in-flight(least loaded) from: fallback
    "kv_cache_usage_limit": 0.95,  # preferred replica's KV usage at/above: fallback
    "text_prefix_chars": 256,  # prompts given as text (no ids): key = hash of this many chars
}


def prefix_routing_key(
    token_ids: Sequence[int], block_size: int = 16, max_blocks: int = 4
) -> str | None:
    """Hash of the first full KV blocks (at most `max_blocks`); None without a full block."""
    full = min(len(token_ids) // block_size, max_blocks)
    if full == 0:
        return None
    data = array("q", token_ids[: full * block_size]).tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def request_routing_key(request: Any, opts: dict[str, Any]) -> str | None:
    """The routing key of an LLMServer.generate request dict (None: route by load only)."""
    if not isinstance(request, dict):
        return None
    explicit = request.get("routing_key")
    if isinstance(explicit, str) and explicit:
        return explicit
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return prefix_routing_key(prompt, opts["block_size"], opts["max_blocks"])
    if isinstance(prompt, str) and len(prompt) >= opts["text_prefix_chars"]:
        # Text prompts (a caller that did not tokenize): a long enough shared text prefix
        # tokenizes to shared leading blocks.
        head = prompt[: opts["text_prefix_chars"]].encode("utf-8", "surrogatepass")
        return hashlib.blake2b(head, digest_size=8).hexdigest()
    return None


def rendezvous_rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """Replica ids ordered by highest random weight for `key` (first = preferred)."""

    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Prefix-cache affinity balanced against load. Configured through request_router_kwargs."""

    # An engine replica's event loop shares its process with the engine thread, so a
    # queue-length probe can take longer than Serve's 0.1 s default on a busy CPU machine;
    # a missed deadline makes the router treat the replica as unavailable for that round.
    queue_len_response_deadline_s = 0.5
    max_queue_len_response_deadline_s = 5.0

    def initialize_state(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown PrefixAffinityRouter kwargs: {sorted(unknown)}")
        self._opts = {**DEFAULTS, **kwargs}
        self._metrics = _router_metrics()

    def _options(self) -> dict[str, Any]:
        # initialize_state runs after __init__; be safe if a caller routes before it.
        if not hasattr(self, "_opts"):
            self.initialize_state()
        return self._opts

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Sleep (with backoff) between rounds when no rank could take the request:
            # without it the routing loop spins and starves the event loop it runs on.
            pending_request.routing_context.should_backoff = True
        # Shuffled first so that equally loaded replicas share the work (sort is stable).
        by_load = sorted(random.sample(candidate_replicas, len(candidate_replicas)), key=self._load)
        preferred = self._preferred(candidate_replicas, pending_request)
        if preferred is None:
            # Ray Serve picks the least loaded within a rank (probing if its cache is cold).
            return [by_load[:2]]
        if self._saturated(preferred, by_load[0]):
            others = [r for r in by_load if r.replica_id != preferred.replica_id]
            return [others[:2], [preferred]] if others else [[preferred]]
        return [[preferred], [r for r in by_load if r.replica_id != preferred.replica_id][:2]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:
        preferred = self._preferred(self._replicas_list, pending_request)
        if preferred is None:
            decision = "load"
        elif preferred.replica_id == replica_id:
            decision = "affinity"
        else:
            decision = "fallback"
        self._metrics.routing(decision)

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        """Hands `replica` to the request this routing task chose it for.

        Serve's base class finds that request by its internal request id, but every handle
        call made while serving one ingress request shares that id (e.g. the prompts of a
        batched /v1/completions), so all but one of them would never be routed. The routing
        task itself knows which request it works on: Serve records it per task.
        """
        task = asyncio.current_task()
        mine = [f for f, t in self._routing_task_by_pending_request_future.items() if t is task]
        for pr in self._pending_requests_to_fulfill:
            if pr.future in mine and not pr.future.done():
                self._record_queue_wait_time(pr)
                pr.future.set_result(replica)
                self._remove_pending_request_from_indices(pr)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    # -- internals -----------------------------------------------------------------------

    def _preferred(
        self, replicas: Sequence[RunningReplica], pending_request: PendingRequest | None
    ) -> RunningReplica | None:
        if pending_request is None or not replicas:
            return None
        request = pending_request.args[0] if pending_request.args else None
        key = request_routing_key(request, self._options())
        if key is None:
            return None
        by_id = {r.replica_id.unique_id: r for r in replicas}
        return by_id[rendezvous_rank(key, list(by_id))[0]]

    def _in_flight(self, replica: RunningReplica) -> int:
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        if cached is not None:
            return cached
        stats = replica.routing_stats or {}
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0))

    def _load(self, replica: RunningReplica) -> tuple[int, float]:
        stats = replica.routing_stats or {}
        return (self._in_flight(replica), float(stats.get("kv_cache_usage", 0.0)))

    def _saturated(self, preferred: RunningReplica, least: RunningReplica) -> bool:
        opts = self._options()
        stats = preferred.routing_stats or {}
        if int(stats.get("waiting", 0)) > 0:
            return True  # the engine itself has no room: it is queueing
        cap = int(stats.get("max_queued_requests", 0))
        if cap and int(stats.get("queued", 0)) * 2 >= cap:
            return True  # half way to rejecting with 429
        if float(stats.get("kv_cache_usage", 0.0)) >= opts["kv_cache_usage_limit"]:
            return True
        if self._in_flight(preferred) >= preferred.max_ongoing_requests:
            return True
        return self._in_flight(preferred) - self._in_flight(least) >= opts["imbalance_threshold"]


def _router_metrics() -> Any:
    from cluster.server.metrics import RouterMetrics

    return RouterMetrics()
