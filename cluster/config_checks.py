"""ServeConfig's checks (cluster/config.py): each bad field is a ValueError naming it, raised
when the config is built, at the edge (flags, a YAML's `args`), never later on the cluster."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

from cluster.config_lora import check_lora
from cluster.config_tenants import check_tenants
from workers.config import ATTENTION_BACKENDS

# The choices of ServeConfig's enumerated fields (cluster/config.py re-exports them).
ROUTERS = ("prefix_affinity", "power_of_two", "kv_events")
# llm: waiting requests + KV-cache usage per replica (cluster/controller/autoscaling.py);
# ongoing_requests: Ray Serve's default policy (--target-ongoing-requests).
AUTOSCALING_POLICIES = ("llm", "ongoing_requests")
DEVICES = ("auto", "cpu", "cuda")


def validate(cfg: Any) -> None:
    """Raises ValueError naming the first bad field of a ServeConfig."""

    def need(ok: bool, name: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{name} {why}, got {getattr(cfg, name)!r}")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in (
        "tensor_parallel_size",
        "num_replicas",
        "target_ongoing_requests",
        "max_ongoing_requests",
        "max_num_seqs",
        "block_size",
        "max_queued_requests",
        "max_queued_tokens",
        "ingress_replicas",
        "grpc_max_message_bytes",
        "max_request_body_bytes",
        "max_n",
        "max_stop_strings",
        "max_stop_string_chars",
        "max_stop_token_ids",
        "max_prompts_per_request",
        "max_chat_messages",
        "grammar_cache_size",
    ):
        need(
            is_int(getattr(cfg, name)) and getattr(cfg, name) >= 1, name, "must be an integer >= 1"
        )
    need(
        is_int(cfg.max_migrations) and cfg.max_migrations >= 0,
        "max_migrations",
        "must be an integer >= 0",
    )
    need(
        is_num(cfg.graceful_shutdown_timeout_s) and cfg.graceful_shutdown_timeout_s > 0,
        "graceful_shutdown_timeout_s",
        "must be a number > 0",
    )
    need(is_num(cfg.grpc_drain_s) and cfg.grpc_drain_s >= 0, "grpc_drain_s", "must be >= 0")
    need(
        is_int(cfg.stream_interval_ms) and 0 <= cfg.stream_interval_ms <= 10_000,
        "stream_interval_ms",
        "must be an integer in [0, 10000]",
    )
    for name in ("max_model_len", "kv_cache_memory_bytes", "max_num_batched_tokens"):
        v = getattr(cfg, name)
        need(v is None or (is_int(v) and v >= 1), name, "must be an integer >= 1 or null")
    need(
        cfg.min_replicas is None or (is_int(cfg.min_replicas) and cfg.min_replicas >= 0),
        "min_replicas",
        "must be an integer >= 0 or null",
    )
    need(
        cfg.max_replicas is None or (is_int(cfg.max_replicas) and cfg.max_replicas >= 1),
        "max_replicas",
        "must be an integer >= 1 or null",
    )
    if cfg.min_replicas is not None and cfg.max_replicas is not None:
        need(cfg.max_replicas >= cfg.min_replicas, "max_replicas", "must be >= min_replicas")
    need(
        is_num(cfg.grammar_timeout_s) and cfg.grammar_timeout_s > 0,
        "grammar_timeout_s",
        "must be a number > 0",
    )
    need(
        is_num(cfg.step_timeout_s) and cfg.step_timeout_s > 0,
        "step_timeout_s",
        "must be a number > 0",
    )
    need(
        is_num(cfg.queue_timeout_s) and cfg.queue_timeout_s >= 0,
        "queue_timeout_s",
        "must be a number >= 0 (0: no limit)",
    )
    need(
        cfg.request_timeout_s is None
        or (is_num(cfg.request_timeout_s) and cfg.request_timeout_s > 0),
        "request_timeout_s",
        "must be a number > 0 or null",
    )
    need(
        (cfg.tls_cert_file is None) == (cfg.tls_key_file is None),
        "tls_key_file",
        "must be set together with tls_cert_file",
    )
    for name in ("tls_cert_file", "tls_key_file"):
        v = getattr(cfg, name)
        need(v is None or (isinstance(v, str) and v != ""), name, "must be a file path or null")
    for name in ("enable_prefix_caching", "engine_process"):
        need(isinstance(getattr(cfg, name), bool), name, "must be a boolean")
    need(cfg.compile is None or isinstance(cfg.compile, bool), "compile", "must be a boolean")
    need(cfg.model is None or isinstance(cfg.model, str), "model", "must be a path string or null")
    need(
        cfg.served_model_name is None
        or (isinstance(cfg.served_model_name, str) and cfg.served_model_name != ""),
        "served_model_name",
        "must be a non-empty string or null",
    )
    need(
        isinstance(cfg.api_key_env, str) and cfg.api_key_env.isidentifier(),
        "api_key_env",
        "must be an environment variable name",
    )
    need(
        isinstance(cfg.num_cpus_per_replica, (int, float))
        and not isinstance(cfg.num_cpus_per_replica, bool)
        and cfg.num_cpus_per_replica > 0,
        "num_cpus_per_replica",
        "must be a number > 0",
    )
    need(cfg.device in DEVICES, "device", f"must be one of {', '.join(DEVICES)}")
    need(
        cfg.attention_backend in ATTENTION_BACKENDS,
        "attention_backend",
        f"must be one of {', '.join(ATTENTION_BACKENDS)}",
    )
    need(isinstance(cfg.async_scheduling, bool), "async_scheduling", "must be a boolean")
    need(
        not cfg.async_scheduling or cfg.tensor_parallel_size == 1,
        "async_scheduling",
        "needs tensor_parallel_size 1 (only rank 0 samples)",
    )
    need(
        cfg.autoscaling_policy in AUTOSCALING_POLICIES,
        "autoscaling_policy",
        f"must be one of {', '.join(AUTOSCALING_POLICIES)}",
    )
    need(
        is_num(cfg.target_waiting_requests) and cfg.target_waiting_requests > 0,
        "target_waiting_requests",
        "must be a number > 0",
    )
    need(
        is_num(cfg.target_kv_cache_usage) and 0 < cfg.target_kv_cache_usage <= 1,
        "target_kv_cache_usage",
        "must be a number in (0, 1]",
    )
    for name in ("upscale_delay_s", "downscale_delay_s"):
        need(is_num(getattr(cfg, name)) and getattr(cfg, name) >= 0, name, "must be a number >= 0")
    need(cfg.request_router in ROUTERS, "request_router", f"must be one of {', '.join(ROUTERS)}")
    need(
        cfg.otlp_endpoint is None
        or (isinstance(cfg.otlp_endpoint, str) and is_http_url(cfg.otlp_endpoint)),
        "otlp_endpoint",
        "must be an http:// or https:// URL or null",
    )
    need(
        is_num(cfg.otlp_sample_ratio) and 0 <= cfg.otlp_sample_ratio <= 1,
        "otlp_sample_ratio",
        "must be a number in [0, 1]",
    )
    check_tenants(cfg)  # the keys file, the tenant header, the default quotas
    check_lora(cfg)  # the adapters and the engine's LoRA limits


def is_http_url(v: str) -> bool:
    """An http(s) URL with a host (where the OTLP exporter can POST)."""
    parts = urlsplit(v)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def is_num(v: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
