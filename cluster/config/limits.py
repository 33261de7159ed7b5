"""The serving-limits section: what one request may ask for, how much may wait per replica,
and how long a request may wait and run (docs/serving.md#request-limits, #overload)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.checks import is_num, need, need_positive_ints
from cluster.config.setting import NETWORK_GROUP, REPLICAS_GROUP, setting

# LimitSettings.max_queued_tokens (why this size: at the field).
DEFAULT_MAX_QUEUED_TOKENS = 2**18


@dataclass(frozen=True)
class LimitSettings:
    """Bounds that keep one request, or a burst, from stalling a replica."""

    max_queued_requests: int = setting(
        128, "waiting requests per replica before HTTP 429", REPLICAS_GROUP
    )
    # Prompt tokens waiting to be prefilled per replica (times n) before HTTP 429: what a
    # queue costs is its prefill, not its request count. 2**18 is max_queued_requests (128)
    # prompts of 2,048 tokens, about the KV cache a default GPU replica holds, so a queue at
    # the cap is work the engine can finish in one cache's worth of time. A request larger
    # than this on its own is still taken when nothing waits.
    max_queued_tokens: int = setting(
        DEFAULT_MAX_QUEUED_TOKENS,
        "prompt tokens (x n) waiting per replica before HTTP 429",
        REPLICAS_GROUP,
    )
    # A request nobody can start soon is better refused (retryable) than left waiting for
    # ever behind a burst: the client can retry elsewhere or back off.
    queue_timeout_s: float = setting(
        60.0,
        "seconds a request may wait for a replica and then for its engine's first step; "
        "longer: HTTP 503 + Retry-After / gRPC UNAVAILABLE; 0: wait as long as it takes",
        REPLICAS_GROUP,
    )
    request_timeout_s: float | None = setting(
        None,
        "seconds a request may take in all on the server; longer: it is aborted, HTTP 504 / "
        "gRPC DEADLINE_EXCEEDED (a stream ends with an error event) (default: no limit)",
        REPLICAS_GROUP,
    )
    # Request bounds, checked at the ingress (cluster/ingress/limits.py) for HTTP and gRPC
    # alike: one request must not be able to stall a replica (n=100000) or make the ingress
    # hold and parse unbounded data. A request over one is a 400 naming the field and limit.
    max_request_body_bytes: int = setting(
        8 * 1024 * 1024,
        "largest HTTP request body, e.g. 8MiB; larger: 413 before the body is read",
        NETWORK_GROUP,
        kind="size",
    )
    max_n: int = setting(128, "most completions (n) one request may ask for", NETWORK_GROUP)
    max_stop_strings: int = setting(16, "most stop strings per request", NETWORK_GROUP)
    max_stop_string_chars: int = setting(256, "longest stop string, in characters", NETWORK_GROUP)
    max_stop_token_ids: int = setting(256, "most stop_token_ids per request", NETWORK_GROUP)
    max_prompts_per_request: int = setting(
        64, "most prompts in one /v1/completions request", NETWORK_GROUP
    )
    max_chat_messages: int = setting(1024, "most messages in one chat request", NETWORK_GROUP)

    def __post_init__(self) -> None:
        need_positive_ints(
            self,
            "max_queued_requests",
            "max_queued_tokens",
            "max_request_body_bytes",
            "max_n",
            "max_stop_strings",
            "max_stop_string_chars",
            "max_stop_token_ids",
            "max_prompts_per_request",
            "max_chat_messages",
        )
        q = self.queue_timeout_s
        need(is_num(q) and q >= 0, "queue_timeout_s", "must be a number >= 0 (0: no limit)", q)
        r = self.request_timeout_s
        need(
            r is None or (is_num(r) and r > 0),
            "request_timeout_s",
            "must be a number > 0 or null",
            r,
        )
