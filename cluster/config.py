"""ServeConfig: everything that shapes the Serve application, validated once at the edge.

Built from the `args:` mapping of a Serve config YAML (`build_app(args)`), or from the
`kvray serve` / `kvray config` flags. Keys are the field names; unknown keys are an error so
a typo in a YAML never silently falls back to a default.

Each field's default and help text are written here once: the CLI flags are generated from
the fields' `Flag` metadata (cluster/cli/flags.py), so a flag can never disagree with the
config it fills.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from workers.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS

DEMO_MODEL_NAME = "kvray-demo"
ROUTERS = ("prefix_affinity", "power_of_two")
DEVICES = ("auto", "cpu", "cuda")
# Ports (DESIGN.md): HTTP is Ray Serve's default, metrics the port KubeRay's Prometheus
# examples scrape. The gRPC port's one literal is cluster/grpc_api/ingress.py's.
DEFAULT_HTTP_PORT = 8000
DEFAULT_METRICS_PORT = 8080

# The --help sections the flags are grouped under.
MODEL_GROUP = "model and engine"
REPLICAS_GROUP = "replicas and routing"
NETWORK_GROUP = "network"


@dataclass(frozen=True)
class Flag:
    """How a ServeConfig field shows on the command line (`kvray serve`, `kvray config`).

    The flag is `--field-name` unless `name` says otherwise; a boolean field that defaults to
    True gets a `--no-...` flag (give its `name`). Non-None defaults are appended to the help
    as "(default X)"; the help of a None default says what None means.
    """

    help: str
    group: str
    name: str | None = None
    aliases: tuple[str, ...] = ()
    kind: str = ""  # "size": takes 2GiB / 512MiB / bytes; "path": made absolute
    choices: tuple[str, ...] = ()


def _opt(default: Any, help: str, group: str, **flag: Any) -> Any:
    return field(default=default, metadata={"flag": Flag(help, group, **flag)})


@dataclass(frozen=True)
class ServeConfig:
    """One kvray Serve application. Field names are the YAML `args` keys."""

    model: str | None = _opt(
        None,
        "Hugging Face checkpoint directory (default: the built-in demo model)",
        MODEL_GROUP,
        kind="path",
    )
    served_model_name: str | None = _opt(
        None, "model id clients send (default: the directory name)", MODEL_GROUP
    )
    tensor_parallel_size: int = _opt(
        1, "GPUs (or CPU ranks) per engine replica", MODEL_GROUP, aliases=("--tp",)
    )
    num_replicas: int = _opt(1, "engine replicas; ignored with autoscaling", REPLICAS_GROUP)
    min_replicas: int | None = _opt(
        None, "autoscaling lower bound (enables autoscaling)", REPLICAS_GROUP
    )
    max_replicas: int | None = _opt(
        None, "autoscaling upper bound (enables autoscaling)", REPLICAS_GROUP
    )
    target_ongoing_requests: int = _opt(16, "autoscaling target per replica", REPLICAS_GROUP)
    # Ray Serve's cap per LLMServer replica.
    max_ongoing_requests: int = _opt(256, "requests in flight per replica", REPLICAS_GROUP)
    # Ray gives an actor OMP_NUM_THREADS = its CPUs (1 by default): the replica and its engine
    # child set torch's threads to this, so a CPU replica computes on every CPU it holds.
    num_cpus_per_replica: float = _opt(
        1.0,
        "CPUs each engine replica reserves; its torch threads follow (rounded, at least 1)",
        REPLICAS_GROUP,
    )
    max_model_len: int | None = _opt(
        None, "context length (default: the checkpoint's)", MODEL_GROUP
    )
    kv_cache_memory_bytes: int | None = _opt(
        None,
        "KV cache size per replica, e.g. 2GiB (default: the engine's choice)",
        MODEL_GROUP,
        name="--kv-cache-memory",
        kind="size",
    )
    max_num_seqs: int = _opt(DEFAULT_MAX_NUM_SEQS, "sequences per engine step", MODEL_GROUP)
    max_num_batched_tokens: int | None = _opt(None, "token budget per engine step", MODEL_GROUP)
    block_size: int = _opt(
        DEFAULT_BLOCK_SIZE,
        "tokens per KV-cache block; the router hashes whole blocks of a prompt",
        MODEL_GROUP,
    )
    enable_prefix_caching: bool = _opt(
        True, "disable the prefix cache", MODEL_GROUP, name="--no-prefix-caching"
    )
    max_queued_requests: int = _opt(
        128, "waiting requests per replica before HTTP 429", REPLICAS_GROUP
    )
    # The key itself never enters the config (nor a YAML): only the name of the env var.
    api_key_env: str = _opt(
        "KVRAY_API_KEY", "env var holding the key on the cluster", NETWORK_GROUP
    )
    device: str = _opt("auto", "auto: cuda when the cluster has GPUs", MODEL_GROUP, choices=DEVICES)
    ingress_replicas: int = _opt(1, "HTTP ingress replicas", REPLICAS_GROUP)
    grpc_max_message_bytes: int = _opt(
        4 * 1024 * 1024,
        "largest gRPC request message, e.g. 4MiB",
        NETWORK_GROUP,
        kind="size",
    )
    # Request bounds, checked at the ingress (cluster/ingress/limits.py) for HTTP and gRPC
    # alike: one request must not be able to stall a replica (n=100000) or make the ingress
    # hold and parse unbounded data. A request over one is a 400 naming the field and limit.
    max_request_body_bytes: int = _opt(
        8 * 1024 * 1024,
        "largest HTTP request body, e.g. 8MiB; larger: 413 before the body is read",
        NETWORK_GROUP,
        kind="size",
    )
    max_n: int = _opt(128, "most completions (n) one request may ask for", NETWORK_GROUP)
    max_stop_strings: int = _opt(16, "most stop strings per request", NETWORK_GROUP)
    max_stop_string_chars: int = _opt(256, "longest stop string, in characters", NETWORK_GROUP)
    max_stop_token_ids: int = _opt(256, "most stop_token_ids per request", NETWORK_GROUP)
    max_prompts_per_request: int = _opt(
        64, "most prompts in one /v1/completions request", NETWORK_GROUP
    )
    max_chat_messages: int = _opt(1024, "most messages in one chat request", NETWORK_GROUP)
    request_router: str = _opt(
        "prefix_affinity",
        "replica choice: prefix-cache affinity + load, or Serve's power-of-two choices",
        REPLICAS_GROUP,
        choices=ROUTERS,
    )
    # Fewer, larger chunks cost the replica -> ingress -> proxy -> client path far less; the
    # first and last chunks go at once. 50 ms is Ray Serve LLM's stream batching interval.
    stream_interval_ms: int = _opt(
        50,
        "most time a streamed token waits to travel with later ones; the wait grows with the "
        "replica's concurrent streams (about 3 ms per stream) up to this, trading chunk "
        "granularity for less per-token work on the HTTP path; 0: every token its own chunk",
        REPLICAS_GROUP,
    )
    # TP = 1: a child process keeps the engine's step loop from waiting for the GIL while the
    # replica's Serve side handles requests and streams.
    engine_process: bool = _opt(
        True,
        "run each replica's engine core on a thread of the replica instead of in a child "
        "process of its own (TP = 1; TP > 1 always uses a thread)",
        REPLICAS_GROUP,
        name="--no-engine-process",
    )

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

    def engine_kwargs(self, model_dir: str) -> dict[str, Any]:
        """`EngineArgs` keyword arguments of one replica's engine (workers/config.py).

        device "auto" leaves the engine to pick (cuda if visible)."""
        return {
            "model": model_dir,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "served_model_name": self.model_name(),
            "device": None if self.device == "auto" else self.device,
        }

    def torch_threads(self) -> int:
        """torch threads of one replica's engine: its reserved CPUs, rounded, at least 1."""
        return max(1, round(self.num_cpus_per_replica))

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
        "block_size",
        "max_queued_requests",
        "ingress_replicas",
        "grpc_max_message_bytes",
        "max_request_body_bytes",
        "max_n",
        "max_stop_strings",
        "max_stop_string_chars",
        "max_stop_token_ids",
        "max_prompts_per_request",
        "max_chat_messages",
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
    need(
        isinstance(cfg.num_cpus_per_replica, (int, float))
        and not isinstance(cfg.num_cpus_per_replica, bool)
        and cfg.num_cpus_per_replica > 0,
        "num_cpus_per_replica",
        "must be a number > 0",
    )
    need(cfg.device in DEVICES, "device", f"must be one of {', '.join(DEVICES)}")
    need(cfg.request_router in ROUTERS, "request_router", f"must be one of {', '.join(ROUTERS)}")
