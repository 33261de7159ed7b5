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
from cluster.kv_priors import PRIOR_STEP_S
from cluster.ray_internals import built_request_router
from cluster.routing.router import live_replicas
from workers.core.block_hash import prompt_block_hashes

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
    prompt = list(inp.prompt_token_ids)
    salt = None if inp.lora is None else inp.lora.lora_int_id
    try:
        router = built_request_router(handle)
        if router is None:
            return None
        replicas = live_replicas(list(router.curr_replicas.values()))
        if not replicas:
            return None
        held = _held_tokens(router, replicas, prompt, salt)
        kv_share = bool(getattr(getattr(router, "_kv_opts", None), "kv_share", False))
        most = max(held.values(), default=0)
        return [
            _load(router, r, held.get(r.replica_id.unique_id, 0), most if kv_share else 0)
            for r in replicas
        ]
    except (RuntimeError, AttributeError, KeyError):
        return None


def _held_tokens(router: Any, replicas: list[Any], prompt: list[int], salt: int | None) -> dict:
    """Replica id -> prompt tokens its prefix cache holds (none without a KV index)."""
    index, opts = getattr(router, "index", None), getattr(router, "_kv_opts", None)
    if index is None or opts is None:
        return {}
    hashes = prompt_block_hashes(prompt, opts.block_size, opts.max_prompt_blocks, salt)
    now = time.monotonic()
    return {
        r.replica_id.unique_id: index.overlap(r.replica_id.unique_id, hashes, now) * opts.block_size
        for r in replicas
    }


def _load(router: Any, replica: Any, held: int, most: int) -> ReplicaLoad:
    stats = replica.routing_stats or {}
    running, waiting = int(stats.get("running", 0)), int(stats.get("waiting", 0))
    # Requests this router sent since the stats: Serve's count of the replica's in-flight
    # requests, less those the stats already show; they are waiting there now.
    in_flight = router.replica_queue_len_cache.get(replica.replica_id)
    unseen = max(0, in_flight - running - waiting) if in_flight is not None else 0
    rates = {k: v for k, v in (stats.get("kv_rates") or {}).items() if k in RATE_FIELDS and v}
    rates.setdefault("step_s", PRIOR_STEP_S)
    return ReplicaLoad(
        cached_tokens=held,
        pullable_tokens=max(0, most - held),
        queued_tokens=int(stats.get("queued_tokens", 0)),
        running=running,
        waiting=waiting + unseen,
        **rates,
    )
