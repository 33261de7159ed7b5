"""ServeConfig: everything that shapes the Serve application, validated once at the edge.

Built from the `args:` mapping of a Serve config YAML (`build_app(args)`), or from the
`kvray serve` / `kvray config` flags. Keys are the field names; unknown keys are an error so
a typo in a YAML never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DEMO_MODEL_NAME = "kvray-demo"
ROUTERS = ("prefix_affinity", "power_of_two")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ServeConfig:
    """One kvray Serve application. Field names are the YAML `args` keys."""

    model: str | None = None  # HF checkpoint dir; None: the built-in demo model
    served_model_name: str | None = None  # None: the model dir's basename, or "kvray-demo"
    tensor_parallel_size: int = 1
    num_replicas: int = 1  # ignored when autoscaling
    min_replicas: int | None = None  # either of min/max set: autoscaling
    max_replicas: int | None = None
    target_ongoing_requests: int = 16  # autoscaling target per LLMServer replica
    max_ongoing_requests: int = 256  # per LLMServer replica (Ray Serve's cap)
    max_model_len: int | None = None  # None: the checkpoint's
    kv_cache_memory_bytes: int | None = None  # None: the engine's default
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    max_queued_requests: int = 128  # waiting requests per replica before 429
    api_key_env: str = "KVRAY_API_KEY"  # env var holding the key on the cluster; unset: no auth
    device: str = "auto"  # auto | cpu | cuda
    ingress_replicas: int = 1
    grpc_max_message_bytes: int = 4 * 1024 * 1024
    request_router: str = "prefix_affinity"  # prefix_affinity | power_of_two (Serve's default)
    # Most time a streamed token may wait to travel with later ones (first and last chunks go
    # at once). The wait grows with the replica's streams up to this; 0: every token at once.
    # Fewer, larger chunks cost the replica -> ingress -> proxy -> client path far less.
    # 50 ms is Ray Serve LLM's stream batching interval.
    stream_interval_ms: int = 50
    # TP = 1: run each replica's engine core in a child process, so its step loop never waits
    # for the GIL while the replica's Serve side handles requests and streams.
    engine_process: bool = True

    def __post_init__(self) -> None:
        _validate(self)

    @staticmethod
    def from_args(args: Mapping[str, Any] | None) -> ServeConfig:
        """Validates a YAML `args` mapping (or flags). Unknown keys raise ValueError."""
        args = dict(args or {})
        known = {f.name for f in fields(ServeConfig)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(
                f"unknown kvray application args: {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(known))}"
            )
        return ServeConfig(**args)

    def to_args(self) -> dict[str, Any]:
        """The YAML `args` mapping: every field that is set (None fields are left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def autoscaling_config(self) -> dict[str, Any] | None:
        """Ray Serve's autoscaling_config for LLMServer, or None for a fixed replica count."""
        if not self.autoscaling:
            return None
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else max(lo, self.num_replicas)
        return {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": max(lo, 1),
            "target_ongoing_requests": self.target_ongoing_requests,
        }

    def model_name(self) -> str:
        """The id clients put in `model`: served_model_name, else the dir's basename."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return Path(self.model.rstrip("/")).name or self.model
        return DEMO_MODEL_NAME


def _validate(cfg: ServeConfig) -> None:
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
        "max_queued_requests",
        "ingress_replicas",
        "grpc_max_message_bytes",
    ):
        need(
            is_int(getattr(cfg, name)) and getattr(cfg, name) >= 1, name, "must be an integer >= 1"
        )
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
    for name in ("enable_prefix_caching", "engine_process"):
        need(isinstance(getattr(cfg, name), bool), name, "must be a boolean")
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
    need(cfg.device in DEVICES, "device", f"must be one of {', '.join(DEVICES)}")
    need(cfg.request_router in ROUTERS, "request_router", f"must be one of {', '.join(ROUTERS)}")
