"""The network section: the API key's variable, TLS for both APIs, the gRPC listener's
message bound and drain, and the engine replicas' gateway metrics port (where the APIs
listen is not part of the app: cluster/cli/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.checks import is_int, is_num, need, need_positive_ints
from cluster.config.setting import NETWORK_GROUP, setting

# Ports (docs/contracts.md): HTTP is Ray Serve's default, metrics the port KubeRay's Prometheus
# examples scrape. The gRPC port's one literal is cluster/grpc_api/ingress.py's.
DEFAULT_HTTP_PORT = 8000
DEFAULT_METRICS_PORT = 8080


@dataclass(frozen=True)
class NetworkSettings:
    """How clients reach the application."""

    # The key itself never enters the config (nor a YAML): only the name of the env var.
    api_key_env: str = setting(
        "KVRAY_API_KEY", "env var holding the key on the cluster", NETWORK_GROUP
    )
    grpc_max_message_bytes: int = setting(
        4 * 1024 * 1024,
        "largest gRPC request message, e.g. 4MiB",
        NETWORK_GROUP,
        kind="size",
    )
    # cluster/grpc_api/ingress.py: health checks and load balancers see NOT_SERVING this long
    # before the listener closes (then in-flight calls get their grace).
    grpc_drain_s: float = setting(
        5.0,
        "seconds the gRPC ingress reports NOT_SERVING on shutdown before it stops listening",
        NETWORK_GROUP,
    )
    # TLS for both APIs. The files are read where the listeners run: by `kvray serve` (HTTP,
    # through Serve's proxy) and by the gRPC ingress replica on the head node.
    tls_cert_file: str | None = setting(
        None,
        "PEM certificate (chain) for HTTPS and gRPC over TLS; needs --tls-key (default: "
        "plain text). HTTP then goes through Serve's own proxy, not HAProxy",
        NETWORK_GROUP,
        name="--tls-cert",
        kind="path",
    )
    tls_key_file: str | None = setting(
        None, "PEM private key of --tls-cert", NETWORK_GROUP, name="--tls-key", kind="path"
    )
    # cluster/replica/gateway_metrics.py: the load gauges a Kubernetes inference gateway's
    # endpoint picker scrapes from each model-server pod, under vLLM's names. One replica per
    # node (pod) can hold the port; another one on that node logs a warning and serves on.
    engine_metrics_port: int = setting(
        0,
        "port on which each engine replica serves GET /metrics with vLLM-named gauges "
        "(vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...) for the endpoint picker "
        "of a Kubernetes inference gateway (0: off)",
        NETWORK_GROUP,
    )

    def __post_init__(self) -> None:
        need_positive_ints(self, "grpc_max_message_bytes")
        p = self.engine_metrics_port
        need(is_int(p) and 0 <= p <= 65535, "engine_metrics_port", "must be a port or 0", p)
        d = self.grpc_drain_s
        need(is_num(d) and d >= 0, "grpc_drain_s", "must be >= 0", d)
        need(
            (self.tls_cert_file is None) == (self.tls_key_file is None),
            "tls_key_file",
            "must be set together with tls_cert_file",
            self.tls_key_file,
        )
        for name in ("tls_cert_file", "tls_key_file"):
            v = getattr(self, name)
            need(
                v is None or (isinstance(v, str) and v != ""),
                name,
                "must be a file path or null",
                v,
            )
        need(
            isinstance(self.api_key_env, str) and self.api_key_env.isidentifier(),
            "api_key_env",
            "must be an environment variable name",
            self.api_key_env,
        )

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None
