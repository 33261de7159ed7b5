"""The replicas section: how many engine and ingress replicas, what each reserves, how
requests are routed to them and streamed back, and what happens when one goes away."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.checks import is_int, is_num, need, need_bools, need_choice, need_positive_ints
from cluster.config.setting import REPLICAS_GROUP, setting

# Replicas one request may fail on and move away from (cluster/ingress/migration.py): enough
# for a rolling upgrade plus a crash, few enough that a request which itself kills engines
# cannot take the whole deployment down with it.
DEFAULT_MAX_MIGRATIONS = 3
ROUTERS = ("prefix_affinity", "power_of_two", "kv_events")


@dataclass(frozen=True)
class ReplicaSettings:
    """The engine replicas (LLMServer) and the HTTP ingress replicas in front of them."""

    num_replicas: int = setting(
        1,
        "engine replicas (with prefill replicas: the decode ones); ignored with autoscaling",
        REPLICAS_GROUP,
        aliases=("--decode-replicas",),
    )
    # Ray Serve's cap per LLMServer replica.
    max_ongoing_requests: int = setting(256, "requests in flight per replica", REPLICAS_GROUP)
    # Ray gives an actor OMP_NUM_THREADS = its CPUs (1 by default): the replica and its engine
    # child set torch's threads to this, so a CPU replica computes on every CPU it holds.
    num_cpus_per_replica: float = setting(
        1.0,
        "CPUs each engine replica reserves; its torch threads follow (rounded, at least 1)",
        REPLICAS_GROUP,
    )
    ingress_replicas: int = setting(1, "HTTP ingress replicas", REPLICAS_GROUP)
    # Migration (cluster/ingress/migration.py): a request whose replica, engine or node dies
    # continues on another replica, token-exact; this many times at most.
    max_migrations: int = setting(
        DEFAULT_MAX_MIGRATIONS,
        "times a request may move to another replica when the one serving it dies (engine, "
        "replica, TP rank or node), then HTTP 503 / gRPC UNAVAILABLE; 0: never",
        REPLICAS_GROUP,
    )
    # A replica Serve stops (scale-down, redeploy, rolling upgrade) finishes its requests for
    # this long; the ones still running then move to other replicas (migration).
    graceful_shutdown_timeout_s: float = setting(
        30.0,
        "seconds a stopped replica keeps serving its in-flight requests before the rest move "
        "to other replicas",
        REPLICAS_GROUP,
    )
    request_router: str = setting(
        "prefix_affinity",
        "replica choice: prefix-cache affinity (hash of the first blocks) + load, kv_events "
        "(the blocks engines report holding, against load), or Serve's power-of-two choices",
        REPLICAS_GROUP,
        choices=ROUTERS,
    )
    # Fewer, larger chunks cost the replica -> ingress -> proxy -> client path far less; the
    # first and last chunks go at once. 50 ms is Ray Serve LLM's stream batching interval.
    stream_interval_ms: int = setting(
        50,
        "most time a streamed token waits to travel with later ones; the wait grows with the "
        "replica's concurrent streams (about 3 ms per stream) up to this, trading chunk "
        "granularity for less per-token work on the HTTP path; 0: every token its own chunk",
        REPLICAS_GROUP,
    )
    # TP = 1: a child process keeps the engine's step loop from waiting for the GIL while the
    # replica's Serve side handles requests and streams.
    engine_process: bool = setting(
        True,
        "run each replica's engine core on a thread of the replica instead of in a child "
        "process of its own (TP = 1; TP > 1 always uses a thread)",
        REPLICAS_GROUP,
        name="--no-engine-process",
    )

    def __post_init__(self) -> None:
        need_positive_ints(self, "num_replicas", "max_ongoing_requests", "ingress_replicas")
        m = self.max_migrations
        need(is_int(m) and m >= 0, "max_migrations", "must be an integer >= 0", m)
        g = self.graceful_shutdown_timeout_s
        need(is_num(g) and g > 0, "graceful_shutdown_timeout_s", "must be a number > 0", g)
        s = self.stream_interval_ms
        need(
            is_int(s) and 0 <= s <= 10_000,
            "stream_interval_ms",
            "must be an integer in [0, 10000]",
            s,
        )
        c = self.num_cpus_per_replica
        need(
            isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0,
            "num_cpus_per_replica",
            "must be a number > 0",
            c,
        )
        need_bools(self, "engine_process")
        need_choice(self, "request_router", ROUTERS)

    def torch_threads(self) -> int:
        """torch threads of one replica's engine: its reserved CPUs, rounded, at least 1."""
        return max(1, round(self.num_cpus_per_replica))
