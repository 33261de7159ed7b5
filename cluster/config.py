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

from cluster.config_autoscaling import AUTOSCALING_LOOK_BACK_S as AUTOSCALING_LOOK_BACK_S
from cluster.config_autoscaling import autoscaling_config
from cluster.config_checks import AUTOSCALING_POLICIES, DEVICES, ROUTERS, validate
from cluster.config_flag import LORA_GROUP as LORA_GROUP
from cluster.config_flag import MODEL_GROUP, NETWORK_GROUP, REPLICAS_GROUP, Flag
from cluster.config_lora import LoraModule, lora_engine_kwargs, lora_field, parse_lora_modules
from cluster.config_tenants import tenant_field
from workers.compile_sizes import CPU_COMPILED_MIN_TOKENS
from workers.config import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GRAMMAR_CACHE_SIZE,
    DEFAULT_GRAMMAR_TIMEOUT_S,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_STEP_TIMEOUT_S,
)

DEMO_MODEL_NAME = "kvray-demo"
# Ports (docs/contracts.md): HTTP is Ray Serve's default, metrics the port KubeRay's Prometheus
# examples scrape. The gRPC port's one literal is cluster/grpc_api/ingress.py's.
DEFAULT_HTTP_PORT = 8000
DEFAULT_METRICS_PORT = 8080
# Replicas one request may fail on and move away from (cluster/ingress/migration.py): enough
# for a rolling upgrade plus a crash, few enough that a request which itself kills engines
# cannot take the whole deployment down with it.
DEFAULT_MAX_MIGRATIONS = 3
# ServeConfig.max_queued_tokens (why this size: at the field).
DEFAULT_MAX_QUEUED_TOKENS = 2**18


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
    target_ongoing_requests: int = _opt(
        16, "autoscaling target per replica (--autoscaling-policy ongoing_requests)", REPLICAS_GROUP
    )
    autoscaling_policy: str = _opt(
        "llm",
        "autoscaling signal: waiting requests and KV-cache usage per replica, or Serve's "
        "ongoing requests",
        REPLICAS_GROUP,
        choices=AUTOSCALING_POLICIES,
    )
    target_waiting_requests: float = _opt(
        4.0, "autoscaling: waiting (admitted, not running) requests per replica", REPLICAS_GROUP
    )
    target_kv_cache_usage: float = _opt(
        0.8, "autoscaling: fraction of each replica's KV cache in use, in (0, 1]", REPLICAS_GROUP
    )
    upscale_delay_s: float = _opt(
        10.0, "autoscaling: seconds the load must ask for more replicas first", REPLICAS_GROUP
    )
    downscale_delay_s: float = _opt(
        120.0,
        "autoscaling: seconds the load must allow fewer replicas first (to zero too, with "
        "--min-replicas 0: the next request then waits for a replica to start)",
        REPLICAS_GROUP,
    )
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
    # workers/device/compile.py; None leaves it to the engine (on only where measured to win).
    compile: bool | None = _opt(
        None,
        "torch.compile the model forward (CUDA: decode batches replay CUDA graphs, other steps "
        f"run eagerly; CPU: steps of {CPU_COMPILED_MIN_TOKENS}+ tokens); default off: on CPU a "
        "few per cent more throughput, on a GPU faster decode steps but not yet a faster run, "
        "for seconds of start-up per engine",
        MODEL_GROUP,
    )
    max_queued_requests: int = _opt(
        128, "waiting requests per replica before HTTP 429", REPLICAS_GROUP
    )
    # Prompt tokens waiting to be prefilled per replica (times n) before HTTP 429: what a
    # queue costs is its prefill, not its request count. 2**18 is max_queued_requests (128)
    # prompts of 2,048 tokens, about the KV cache a default GPU replica holds, so a queue at
    # the cap is work the engine can finish in one cache's worth of time. A request larger
    # than this on its own is still taken when nothing waits.
    max_queued_tokens: int = _opt(
        DEFAULT_MAX_QUEUED_TOKENS,
        "prompt tokens (x n) waiting per replica before HTTP 429",
        REPLICAS_GROUP,
    )
    # The key itself never enters the config (nor a YAML): only the name of the env var.
    api_key_env: str = _opt(
        "KVRAY_API_KEY", "env var holding the key on the cluster", NETWORK_GROUP
    )
    device: str = _opt("auto", "auto: cuda when the cluster has GPUs", MODEL_GROUP, choices=DEVICES)
    attention_backend: str = _opt(  # workers/device/attention_backend.py
        "auto", "auto: torch (triton: opt-in on CUDA)", MODEL_GROUP, choices=ATTENTION_BACKENDS
    )
    # workers/core/engine.py: schedule step N+1 while step N runs (one rank only).
    async_scheduling: bool = _opt(
        False,
        "schedule and launch each engine step before the last one's tokens reach the host, so "
        "the host's work overlaps the GPU's (tensor_parallel_size 1)",
        MODEL_GROUP,
    )
    ingress_replicas: int = _opt(1, "HTTP ingress replicas", REPLICAS_GROUP)
    grpc_max_message_bytes: int = _opt(
        4 * 1024 * 1024,
        "largest gRPC request message, e.g. 4MiB",
        NETWORK_GROUP,
        kind="size",
    )
    # cluster/grpc_api/ingress.py: health checks and load balancers see NOT_SERVING this long
    # before the listener closes (then in-flight calls get their grace).
    grpc_drain_s: float = _opt(
        5.0,
        "seconds the gRPC ingress reports NOT_SERVING on shutdown before it stops listening",
        NETWORK_GROUP,
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
    # TLS for both APIs. The files are read where the listeners run: by `kvray serve` (HTTP,
    # through Serve's proxy) and by the gRPC ingress replica on the head node.
    tls_cert_file: str | None = _opt(
        None,
        "PEM certificate (chain) for HTTPS and gRPC over TLS; needs --tls-key (default: "
        "plain text). HTTP then goes through Serve's own proxy, not HAProxy",
        NETWORK_GROUP,
        name="--tls-cert",
        kind="path",
    )
    tls_key_file: str | None = _opt(
        None, "PEM private key of --tls-cert", NETWORK_GROUP, name="--tls-key", kind="path"
    )
    # Liveness: a replica whose engine has work and completes no step for this long fails its
    # requests and its health check, and Serve replaces it.
    step_timeout_s: float = _opt(
        DEFAULT_STEP_TIMEOUT_S,
        "seconds an engine step may take before the replica counts as hung and is replaced",
        MODEL_GROUP,
    )
    # Structured outputs: grammars compile off the engine's step loop, into a bounded cache.
    grammar_timeout_s: float = _opt(
        DEFAULT_GRAMMAR_TIMEOUT_S,
        "seconds a structured-output constraint may take to compile; longer: HTTP 400 / "
        "INVALID_ARGUMENT naming structured_outputs",
        MODEL_GROUP,
    )
    grammar_cache_size: int = _opt(
        DEFAULT_GRAMMAR_CACHE_SIZE, "compiled constraints each engine keeps (LRU)", MODEL_GROUP
    )
    # A request nobody can start soon is better refused (retryable) than left waiting for
    # ever behind a burst: the client can retry elsewhere or back off.
    queue_timeout_s: float = _opt(
        60.0,
        "seconds a request may wait for a replica and then for its engine's first step; "
        "longer: HTTP 503 + Retry-After / gRPC UNAVAILABLE; 0: wait as long as it takes",
        REPLICAS_GROUP,
    )
    request_timeout_s: float | None = _opt(
        None,
        "seconds a request may take in all on the server; longer: it is aborted, HTTP 504 / "
        "gRPC DEADLINE_EXCEEDED (a stream ends with an error event) (default: no limit)",
        REPLICAS_GROUP,
    )
    # Migration (cluster/ingress/migration.py): a request whose replica, engine or node dies
    # continues on another replica, token-exact; this many times at most.
    max_migrations: int = _opt(
        DEFAULT_MAX_MIGRATIONS,
        "times a request may move to another replica when the one serving it dies (engine, "
        "replica, TP rank or node), then HTTP 503 / gRPC UNAVAILABLE; 0: never",
        REPLICAS_GROUP,
    )
    # A replica Serve stops (scale-down, redeploy, rolling upgrade) finishes its requests for
    # this long; the ones still running then move to other replicas (migration).
    graceful_shutdown_timeout_s: float = _opt(
        30.0,
        "seconds a stopped replica keeps serving its in-flight requests before the rest move "
        "to other replicas",
        REPLICAS_GROUP,
    )
    request_router: str = _opt(
        "prefix_affinity",
        "replica choice: prefix-cache affinity (hash of the first blocks) + load, kv_events "
        "(the blocks engines report holding, against load), or Serve's power-of-two choices",
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
    # OpenTelemetry tracing (cluster/tracing.py, docs/serving.md#tracing): off costs nothing.
    otlp_endpoint: str | None = _opt(
        None,
        "export traces over OTLP/HTTP to this URL, e.g. http://collector:4318 (/v1/traces is "
        "added when the URL has no path); needs pip install 'kvray[otel]' (default: off)",
        NETWORK_GROUP,
    )
    otlp_sample_ratio: float = _opt(
        1.0, "fraction of new traces kept; an incoming traceparent decides", NETWORK_GROUP
    )
    # Tenants and quotas: help and checks in cluster/config_tenants.py.
    api_keys_file: str | None = tenant_field("api_keys_file")
    tenant_header: str | None = tenant_field("tenant_header")
    tenant_requests_per_s: float | None = tenant_field("tenant_requests_per_s")
    tenant_tokens_per_s: float | None = tenant_field("tenant_tokens_per_s")
    # LoRA adapters and expert parallelism: help and checks in cluster/config_lora.py.
    enable_lora: bool = lora_field("enable_lora")
    lora_modules: tuple[LoraModule, ...] | None = lora_field("lora_modules")
    max_loras: int = lora_field("max_loras")
    max_lora_rank: int = lora_field("max_lora_rank")
    max_cpu_loras: int | None = lora_field("max_cpu_loras")
    enable_runtime_lora: bool = lora_field("enable_runtime_lora")
    enable_expert_parallel: bool = lora_field("enable_expert_parallel")

    def __post_init__(self) -> None:
        # YAML lists and flag strings become LoraModules (frozen: set through object).
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
        validate(self)

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
        args = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.lora_modules:  # YAML has no tuples: a list of mappings
            args["lora_modules"] = [m.to_arg() for m in self.lora_modules]
        return args

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def autoscaling_config(self) -> dict[str, Any] | None:
        """Ray Serve's autoscaling_config for LLMServer, or None for a fixed replica count."""
        return autoscaling_config(self)

    def engine_kwargs(self, model_dir: str) -> dict[str, Any]:
        """`EngineArgs` keyword arguments of one replica's engine (workers/config.py).

        device "auto" leaves the engine to pick (cuda if visible)."""
        return {
            "model": model_dir,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "compile": self.compile,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "served_model_name": self.model_name(),
            "device": None if self.device == "auto" else self.device,
            "attention_backend": self.attention_backend,
            "async_scheduling": self.async_scheduling,
            "step_timeout_s": self.step_timeout_s,
            "grammar_timeout_s": self.grammar_timeout_s,
            "grammar_cache_size": self.grammar_cache_size,
            # Engines record prefix-cache events only for the router that reads them.
            "kv_events": self.request_router == "kv_events",
            **lora_engine_kwargs(self),  # LoRA and expert parallelism
        }

    def ingress_max_in_flight(self) -> int:
        """Generation requests one HTTP ingress replica holds at once; more get 429 at the
        door (cluster/http/guard.py). What the engine replicas can take between them (each
        `max_ongoing_requests`) plus what Serve's router may queue in front of them: a request
        beyond that would be refused anyway, later and after costing the ingress its parsing."""
        replicas = self.max_replicas if self.max_replicas is not None else self.num_replicas
        total = (max(replicas, 1) + 1) * self.max_ongoing_requests + self.max_queued_requests
        return -(-total // self.ingress_replicas)

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


def resolve_model_dir(config: ServeConfig) -> str:
    """The checkpoint directory on this node: config.model, or the built-in demo model."""
    if config.model:
        return config.model
    from workers.demo import demo_model_dir

    return str(demo_model_dir())
