"""The dashboard's rows about how the replicas hold up: saturation, prefix cache, errors and
rejections, and capacity: the autoscaler's own signals, and headroom against the measured
peak per replica."""

from __future__ import annotations

from dashboard_panels import (
    ENGINE_REPLICAS,
    GEN_RATE,
    KV_NEED,
    MR,
    OK_CODES,
    REJECTED_CODES,
    REPLICAS_NEEDED,
    SERVE,
    SERVER_ERROR_CODES,
    WAITING_NEED,
    M,
    Panel,
    Row,
    Target,
    code_ratio,
    quantiles,
    rate,
)

REPLICA_ROWS: tuple[Row, ...] = (
    Row(
        "Saturation per replica",
        (
            Panel(
                "Running requests",
                "Requests in each replica's running batch.",
                (
                    Target(
                        f"max by (replica) (ray_kvray_num_requests_running{{{MR}}})", "{{replica}}"
                    ),
                ),
                width=6,
            ),
            Panel(
                "Waiting requests",
                "Requests queued in each replica, not yet scheduled. Persistently above 0 means "
                "the replica is saturated.",
                (
                    Target(
                        f"max by (replica) (ray_kvray_num_requests_waiting{{{MR}}})", "{{replica}}"
                    ),
                ),
                width=6,
            ),
            Panel(
                "KV cache usage",
                "Fraction of each replica's KV-cache blocks in use.",
                (
                    Target(
                        f"max by (replica) (ray_kvray_kv_cache_usage_ratio{{{MR}}})", "{{replica}}"
                    ),
                ),
                unit="percentunit",
                width=6,
                min=0,
                max=1,
            ),
            Panel(
                "Preemptions/s",
                "Requests preempted per second per replica because KV blocks ran out; their "
                "work is recomputed later.",
                (Target(rate("ray_kvray_num_preemptions_total", MR, "replica"), "{{replica}}"),),
                width=6,
            ),
            Panel(
                "KV cache capacity (blocks)",
                "Total KV-cache blocks per replica, set by --kv-cache-memory and the model's "
                "shape.",
                (Target(f"max by (replica) (ray_kvray_kv_cache_blocks{{{MR}}})", "{{replica}}"),),
                width=12,
                height=6,
            ),
            Panel(
                "CPU kernels",
                "What each replica's engine runs: its CPU kernels on (AMX, AVX-512 or AVX2) or "
                "off and why (kvray_engine_info's cpu_kernels label).",
                (
                    Target(
                        f"max by (replica, cpu_kernels) (ray_kvray_engine_info{{{MR}}})",
                        "{{replica}}: {{cpu_kernels}}",
                    ),
                ),
                width=12,
                height=6,
            ),
        ),
    ),
    Row(
        "Prefix cache",
        (
            Panel(
                "Prefix-cache hit ratio",
                "Share of looked-up prompt tokens found in each replica's prefix cache. The "
                "prefix-affinity router raises it for shared-prefix traffic.",
                (
                    Target(
                        f"{rate('ray_kvray_prefix_cache_hits_total', MR, 'replica')}"
                        f" / {rate('ray_kvray_prefix_cache_queries_total', MR, 'replica')}",
                        "{{replica}}",
                    ),
                ),
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Prefix-cache tokens/s",
                "Prompt tokens looked up and found in the prefix cache per second, all replicas.",
                (
                    Target(rate("ray_kvray_prefix_cache_queries_total", M), "looked up"),
                    Target(rate("ray_kvray_prefix_cache_hits_total", M), "hit"),
                ),
            ),
            Panel(
                "Routing decisions",
                "Router choices per second: affinity (prefix-preferred replica), load "
                "(least loaded), fallback (preferred replica saturated).",
                (Target(rate("ray_kvray_router_routing_total", by="decision"), "{{decision}}"),),
                unit="reqps",
            ),
            Panel(
                "Host KV tier traffic",
                "The host KV tier (--kv-offload-gib), all replicas: prompt tokens restored from "
                "it instead of computed per second, and KV blocks per second copied out to it "
                "(evicted from the device), back in, and dropped from it to make room.",
                (
                    Target(rate("ray_kvray_kv_offload_hit_tokens_total", M), "restored tokens"),
                    Target(rate("ray_kvray_kv_offload_copies_out_total", M), "blocks out"),
                    Target(rate("ray_kvray_kv_offload_copies_in_total", M), "blocks in"),
                    Target(rate("ray_kvray_kv_offload_evictions_total", M), "blocks dropped"),
                ),
            ),
            Panel(
                "Host KV tier size",
                "Bytes of KV blocks each replica's host tier holds, next to what it may hold "
                "(0: the tier is off).",
                (
                    Target(f"max by (replica) (ray_kvray_kv_offload_bytes{{{MR}}})", "{{replica}}"),
                    Target(
                        f"max by (replica) (ray_kvray_kv_offload_capacity_bytes{{{MR}}})",
                        "{{replica}} capacity",
                    ),
                ),
                unit="bytes",
            ),
            Panel(
                "Host KV tier blocks",
                "KV blocks each replica's host tier holds: prefixes evicted from the device "
                "that a later prompt can get back without computing them.",
                (Target(f"max by (replica) (ray_kvray_kv_offload_blocks{{{MR}}})", "{{replica}}"),),
            ),
            Panel(
                "Speculative decoding",
                "Speculative decoding (--speculative-config), all replicas, per second: draft "
                "tokens proposed and verified, draft tokens the model accepted (their ratio is "
                "the acceptance rate), and drafts verified (1 + accepted / drafts: tokens per "
                "verifying step). All 0 with speculation off.",
                (
                    Target(rate("ray_kvray_spec_decode_draft_tokens_total", M), "draft tokens"),
                    Target(rate("ray_kvray_spec_decode_accepted_tokens_total", M), "accepted"),
                    Target(rate("ray_kvray_spec_decode_drafts_total", M), "drafts"),
                ),
            ),
            Panel(
                "Cluster KV tier pulls",
                "The cluster KV tier (--kv-share-gib), all replicas, per second: requests by pull "
                "decision (pulled from a peer, recompute when computing was cheaper, miss when "
                "nothing was published, failed), prompt tokens pulled instead of computed, and "
                "KV blocks published, dropped unpublished and refused by a check.",
                (
                    Target(rate("ray_kvray_kv_share_pulls_total", M, by="outcome"), "{{outcome}}"),
                    Target(rate("ray_kvray_kv_share_pulled_tokens_total", M), "pulled tokens"),
                    Target(rate("ray_kvray_kv_share_published_blocks_total", M), "published"),
                    Target(rate("ray_kvray_kv_share_dropped_blocks_total", M), "dropped"),
                    Target(rate("ray_kvray_kv_share_refused_blocks_total", M), "refused"),
                ),
            ),
            Panel(
                "Cluster KV tier pull time",
                "Seconds a pull from the cluster KV tier took (lookup, transfer and checks).",
                quantiles("ray_kvray_kv_share_pull_seconds", M, (0.5, 0.99)),
                unit="s",
            ),
        ),
    ),
    Row(
        "Structured outputs",
        (
            Panel(
                "Structured requests/s",
                "Requests per second with a structured-output constraint (JSON schema, regex, "
                "choice, grammar, or tool calls), and those whose compiled grammar was cached.",
                (
                    Target(rate("ray_kvray_structured_requests_total", M), "constrained"),
                    Target(rate("ray_kvray_grammar_cache_hits_total", M), "grammar cached"),
                ),
                unit="reqps",
            ),
            Panel(
                "Grammar compile time",
                "Seconds to compile one constraint, off the engine's step loop; a request "
                "waits for its own (grammar_timeout_s at most), others do not.",
                quantiles("ray_kvray_grammar_compile_seconds", M, (0.5, 0.99)),
                unit="s",
            ),
        ),
    ),
    Row(
        "Errors and rejections",
        (
            Panel(
                "Non-OK responses",
                "Answers other than 2xx / OK per second by protocol and code: 4xx are client "
                "errors, 429 / RESOURCE_EXHAUSTED admission control, 5xx server errors.",
                (
                    Target(
                        rate(
                            "ray_kvray_router_requests_total",
                            f'code!~"{OK_CODES}"',
                            "protocol, code",
                        )
                        # A flat 0 labelled "none" while every answer was OK.
                        + ' or label_replace(vector(0), "code", "none", "", "")',
                        "{{protocol}} {{code}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Rejected and failed ratio",
                "Share of requests rejected as overloaded (429 / RESOURCE_EXHAUSTED) and failed "
                "with a server error. The alert rules fire above 5% and 1%.",
                (
                    Target(code_ratio(REJECTED_CODES), "rejected (429)"),
                    Target(code_ratio(SERVER_ERROR_CODES), "server error (5xx)"),
                ),
                unit="percentunit",
            ),
            Panel(
                "Rejections by reason",
                "Requests turned away before reaching an engine, by reason (e.g. the bounded "
                "waiting queue is full).",
                (Target(rate("ray_kvray_router_rejected_total", by="reason"), "{{reason}}"),),
                unit="reqps",
            ),
            Panel(
                "Request migrations",
                "Requests moved to another replica because theirs died (engine, replica, TP "
                "rank or node) or was stopped, by cause; each continues where it was.",
                (Target(rate("ray_kvray_request_migrations_total", by="cause"), "{{cause}}"),),
                unit="reqps",
            ),
            Panel(
                "Migration: failure to next token",
                "Time from a replica failure to the migrated request's next token (re-routing "
                "plus the re-prefill of prompt and output so far), median and p99.",
                quantiles("ray_kvray_migration_resume_seconds", "", (0.5, 0.99)),
                unit="s",
            ),
        ),
    ),
    Row(
        "Capacity and headroom",
        (
            Panel(
                "Replicas needed (autoscaler signals)",
                "Replicas the current load needs by the signals the autoscaler scales on: "
                "requests waiting and KV-cache usage, summed over replicas, over their "
                "per-replica targets (the 'Target waiting requests' and 'Target KV-cache usage' "
                "variables); the larger of the two, rounded up.",
                (Target(REPLICAS_NEEDED),),
                kind="stat",
                width=6,
                height=8,
            ),
            Panel(
                "Autoscaler signals vs target",
                "Each signal the autoscaler scales on, per running replica, as a fraction of its "
                "target: above 1 it adds replicas (after its upscale delay); well under 1 (0.7) "
                "it removes them (after its downscale delay).",
                (
                    Target(f"{WAITING_NEED} / {ENGINE_REPLICAS}", "waiting requests / target"),
                    Target(f"{KV_NEED} / {ENGINE_REPLICAS}", "KV-cache usage / target"),
                    Target("vector(1)", "scale-up threshold"),
                ),
                unit="percentunit",
                width=18,
            ),
            Panel(
                "Utilisation",
                "Current output tokens/s over what the running engine replicas sustain at peak "
                "(the 'Peak output tokens/s per replica' variable, measured with "
                "`kvray bench serve`).",
                (Target(f"{GEN_RATE} / ({ENGINE_REPLICAS} * $peak_tokens_per_replica)"),),
                unit="percentunit",
                kind="stat",
                width=6,
                height=5,
                thresholds=(("green", None), ("orange", 0.7), ("red", 0.9)),
            ),
            Panel(
                "Replicas needed now",
                "Replicas the current output token rate needs at the measured peak per replica.",
                (Target(f"ceil({GEN_RATE} / $peak_tokens_per_replica)"),),
                kind="stat",
                width=6,
                height=5,
            ),
            Panel(
                "Replicas needed for target",
                "Replicas the 'Target load' variable (output tokens/s) needs at the measured peak "
                "per replica.",
                (Target("ceil(vector($target_tokens_per_s / $peak_tokens_per_replica))"),),
                kind="stat",
                width=6,
                height=5,
            ),
            Panel(
                "Replicas to add for target",
                "Replicas needed for the target load minus the engine replicas running now "
                "(0 when there is enough).",
                (
                    Target(
                        "clamp_min(ceil(vector($target_tokens_per_s / $peak_tokens_per_replica))"
                        f" - scalar({ENGINE_REPLICAS}), 0)"
                    ),
                ),
                kind="stat",
                width=6,
                height=5,
            ),
            Panel(
                "Output tokens/s per replica vs peak",
                "Each replica's output token rate against its measured peak: the gap is the "
                "headroom left on that replica.",
                (
                    Target(rate("ray_kvray_generation_tokens_total", MR, "replica"), "{{replica}}"),
                    Target("vector($peak_tokens_per_replica)", "peak per replica"),
                ),
                width=12,
            ),
            Panel(
                "Replica count",
                "Engine replicas reporting metrics against Ray Serve's healthy and target "
                "replica counts for the LLM deployment.",
                (
                    Target(ENGINE_REPLICAS, "engine replicas reporting"),
                    Target(f"sum(ray_serve_deployment_replica_healthy{{{SERVE}}})", "healthy"),
                    Target(f"max(ray_serve_autoscaling_target_replicas{{{SERVE}}})", "target"),
                    Target(REPLICAS_NEEDED, "needed (autoscaler signals)"),
                ),
                width=12,
                decimals=0,
            ),
        ),
    ),
)
