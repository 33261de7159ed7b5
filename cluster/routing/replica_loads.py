"""Each replica of a deployment as its router sees it, for one prompt: what disaggregation's
`auto` weighs (cluster/ingress/pd_cost.py).

The router (one per handle, in the ingress's process) already holds what the estimate needs:
every replica's last routing stats (load, and, with the cluster KV tier, its measured rates:
`kv_rates`, cluster/replica/kv_share.py), Serve's queue-length cache (requests this router
sent that the stats do not show yet) and, for the KV-event router, the index of the blocks
each replica holds. Under kvray's Serve settings (cluster/deploy/serve_env.py) the router runs
on the ingress's own event loop, as this read does. Under Serve's default it runs on a
thread of its own: then each read here is of a dict or a counter that the router replaces or
updates whole, and a read that races a change (a dict resized while copied) gives up, so the
caller decides without the estimate for that request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cluster.ingress.pd_cost import ReplicaLoad
from cluster.ray_internals import built_request_router
from cluster.routing.kv_router import KvEventsRouter
from cluster.routing.router import live_replicas

if TYPE_CHECKING:
    from workers.inputs import EngineInput

# The measured figures a replica publishes under `kv_rates`, as ReplicaLoad names them.
RATE_FIELDS = (
    "prefill_tokens_per_s",
    "step_s",
    "pull_bytes_per_s",
    "pull_overhead_s",
    "kv_bytes_per_token",
)


def replica_loads(handle: Any, inp: EngineInput) -> list[ReplicaLoad] | None:
    """The live replicas behind `handle` (a DeploymentHandle) for `inp`'s prompt; None while
    the handle has no router yet, or the read raced the router (module doc)."""
    salt = None if inp.lora is None else inp.lora.lora_int_id
    try:
        router = built_request_router(handle)
        if router is None:
            return None
        replicas = live_replicas(list(router.curr_replicas.values()))
        if not replicas:
            return None
        held: dict[str, int] = {}
        pullable: dict[str, int] = {}
        if isinstance(router, KvEventsRouter):  # other routers keep no KV index
            now = time.monotonic()
            _, held, pullable = router.prompt_blocks(replicas, inp.prompt_token_ids, salt, now)
        bs = router._opts.block_size
        loads = []
        for r in replicas:
            rid = r.replica_id.unique_id
            loads.append(_load(router, r, bs * held.get(rid, 0), bs * pullable.get(rid, 0)))
        return loads
    except (RuntimeError, AttributeError, KeyError):
        return None


def _load(router: Any, replica: Any, held: int, pullable: int) -> ReplicaLoad:
    stats = replica.routing_stats or {}
    running, waiting = int(stats.get("running", 0)), int(stats.get("waiting", 0))
    # Requests this router sent since the stats: Serve's count of the replica's in-flight
    # requests, less those the stats already show; they are waiting there now.
    in_flight = router.replica_queue_len_cache.get(replica.replica_id)
    unseen = max(0, in_flight - running - waiting) if in_flight is not None else 0
    # A figure the replica has not measured yet (0) keeps ReplicaLoad's prior.
    rates = {k: v for k, v in (stats.get("kv_rates") or {}).items() if k in RATE_FIELDS and v}
    return ReplicaLoad(
        cached_tokens=held,
        pullable_tokens=pullable,
        queued_tokens=int(stats.get("queued_tokens", 0)),
        running=running,
        waiting=waiting + unseen,
        **rates,
    )
