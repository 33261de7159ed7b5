"""The dashboard's rows about what clients see: overview, traffic and latency."""

from __future__ import annotations

from dashboard_panels import (
    ENGINE_REPLICAS,
    GEN_RATE,
    SERVE,
    SERVER_ERROR_CODES,
    M,
    Panel,
    Row,
    Target,
    code_ratio,
    quantiles,
    rate,
)

P3 = (0.5, 0.9, 0.99)

TRAFFIC_ROWS: tuple[Row, ...] = (
    Row(
        "Overview",
        (
            Panel(
                "Request rate",
                "Requests answered per second by the HTTP and gRPC ingresses, all status codes.",
                (Target(rate("ray_kvray_router_requests_total")),),
                unit="reqps",
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Output tokens/s",
                "Generated tokens per second over the selected models (counted when each "
                "request finishes).",
                (Target(GEN_RATE),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Engine replicas",
                "Engine replicas reporting metrics. A replica's series disappear about two Ray "
                "export intervals after its process dies.",
                (Target(ENGINE_REPLICAS),),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Serve replicas healthy / target",
                "Ray Serve's own view of the LLM deployment: replicas passing health checks and "
                "the replica count its autoscaler (or num_replicas) asks for.",
                (
                    Target(f"sum(ray_serve_deployment_replica_healthy{{{SERVE}}})", "healthy"),
                    Target(f"max(ray_serve_autoscaling_target_replicas{{{SERVE}}})", "target"),
                ),
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "TTFT p99",
                "99th percentile time to first token over the selected models.",
                quantiles("ray_kvray_time_to_first_token_seconds", M, (0.99,)),
                unit="s",
                kind="stat",
                width=4,
                height=4,
            ),
            Panel(
                "Server error ratio",
                "Share of requests answered with a 5xx (HTTP) or INTERNAL / UNAVAILABLE / "
                "UNKNOWN / DATA_LOSS (gRPC).",
                (Target(code_ratio(SERVER_ERROR_CODES)),),
                unit="percentunit",
                kind="stat",
                width=4,
                height=4,
            ),
        ),
    ),
    Row(
        "Traffic",
        (
            Panel(
                "Token throughput",
                "Prompt and generated tokens per second, per model. Tokens are counted when a "
                "request finishes, so long generations show up at their end.",
                (
                    Target(rate("ray_kvray_prompt_tokens_total", M, "model"), "{{model}} prompt"),
                    Target(
                        rate("ray_kvray_generation_tokens_total", M, "model"),
                        "{{model}} generation",
                    ),
                ),
            ),
            Panel(
                "Requests by protocol and status",
                "Ingress answers per second by protocol (http, grpc) and status code.",
                (
                    Target(
                        rate("ray_kvray_router_requests_total", by="protocol, code"),
                        "{{protocol}} {{code}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Requests by kind",
                "Requests that passed the ingresses' checks, per second, by kind: generation, "
                "embedding (/v1/embeddings, Embed) and scoring (prompt logprobs, e.g. echo with "
                "logprobs).",
                (
                    Target(
                        rate("ray_kvray_router_requests_by_kind_total", by="kind"),
                        "{{kind}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Finished requests by reason",
                "Requests leaving the engines per second: stop (EOS / stop sequence), length "
                "(max_tokens), abort (client went away or cancelled).",
                (
                    Target(
                        rate("ray_kvray_request_success_total", M, "finish_reason"),
                        "{{finish_reason}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Request size (tokens)",
                "Median and p99 prompt and generation length per request: the workload mix the "
                "headroom figure was measured with should resemble this.",
                quantiles("ray_kvray_request_prompt_tokens", M, (0.5, 0.99), name="prompt")
                + quantiles(
                    "ray_kvray_request_generation_tokens", M, (0.5, 0.99), name="generation"
                ),
                width=8,
                soft_min=0,
            ),
            Panel(
                "Tokens per engine step",
                "Median and p99 tokens each engine step processes (prefill chunks plus one per "
                "decoding request): how full the batches are.",
                quantiles("ray_kvray_iteration_tokens", M, (0.5, 0.99)),
                width=8,
            ),
        ),
    ),
    Row(
        "Latency",
        (
            Panel(
                "Time to first token",
                "Arrival to first generated token, p50 / p90 / p99 per model. Includes queueing "
                "and prefill.",
                quantiles("ray_kvray_time_to_first_token_seconds", M, P3, by="model"),
                unit="s",
                width=6,
            ),
            Panel(
                "Inter-token latency",
                "Time between consecutive generated tokens, p50 / p90 / p99 per model.",
                quantiles("ray_kvray_inter_token_latency_seconds", M, P3, by="model"),
                unit="s",
                width=6,
            ),
            Panel(
                "End-to-end latency",
                "Arrival to finish, p50 / p90 / p99 per model.",
                quantiles("ray_kvray_e2e_request_latency_seconds", M, P3, by="model"),
                unit="s",
                width=6,
            ),
            Panel(
                "Queue time",
                "Arrival to first scheduled, p50 / p99 per model: time spent waiting for a "
                "batch slot or KV blocks.",
                quantiles("ray_kvray_request_queue_time_seconds", M, (0.5, 0.99), by="model"),
                unit="s",
                width=6,
            ),
        ),
    ),
    Row(
        "Prefill/decode disaggregation",
        (
            Panel(
                "Disaggregation decisions/s",
                "With prefill replicas: requests per second sent to a prefill replica first "
                "(disaggregated) or kept on a decode replica (why: cheaper_local, short, resumed, "
                "unsupported, no_room), and fallbacks, where the decode replica computed the "
                "prompt after all (prefill_failed, pull_missed).",
                (
                    Target(rate("ray_kvray_pd_decisions_total", by="decision"), "{{decision}}"),
                    Target(rate("ray_kvray_pd_fallback_total", by="reason"), "fallback {{reason}}"),
                ),
                width=12,
            ),
            Panel(
                "Hand-off time",
                "From sending a request to a prefill replica to its first tokens with the "
                "prompt's KV published (prefill queue, prefill, publish), p50 / p99.",
                quantiles("ray_kvray_pd_handoff_seconds", "", (0.5, 0.99)),
                unit="s",
                width=12,
            ),
            Panel(
                "Disaggregated TTFT by phase",
                "Mean seconds of a disaggregated request's time to its first decoded token, "
                "by phase: the prefill replica's queue and prefill, the hand-off (hand-off "
                "token, publishing the KV, the hops), the transfer (the decode replica's pull) "
                "and the decode replica's queue and first step.",
                (
                    Target(
                        f"{rate('ray_kvray_pd_ttft_seconds_sum', by='phase')} / "
                        f"{rate('ray_kvray_pd_ttft_seconds_count', by='phase')}",
                        "{{phase}}",
                    ),
                ),
                unit="s",
                width=12,
            ),
        ),
    ),
)
