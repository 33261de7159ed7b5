"""The flags `kvray serve` and `kvray config` share, and their translation into a ServeConfig.

Imported by `kvray --help`: nothing heavy (no ray, torch, transformers) at module level.
"""

from __future__ import annotations

import argparse
import os

from cluster.bench.common import parse_size
from cluster.config import DEVICES, ROUTERS, ServeConfig

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 9000
DEFAULT_METRICS_PORT = 8080
API_KEY_ENV = "KVRAY_API_KEY"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_serve_flags(parser: argparse.ArgumentParser, default_host: str) -> None:
    d = ServeConfig()
    m = parser.add_argument_group("model and engine")
    m.add_argument(
        "--model", help="Hugging Face checkpoint directory (default: the built-in demo model)"
    )
    m.add_argument(
        "--served-model-name", help="model id clients send (default: the directory name)"
    )
    m.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=d.tensor_parallel_size,
        help="GPUs (or CPU ranks) per engine replica (default %(default)s)",
    )
    m.add_argument("--max-model-len", type=int, help="context length (default: the checkpoint's)")
    m.add_argument(
        "--kv-cache-memory",
        type=_size,
        help="KV cache size per replica, e.g. 2GiB (default: the engine's choice)",
    )
    m.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="sequences per engine step (default %(default)s)",
    )
    m.add_argument("--max-num-batched-tokens", type=int, help="token budget per engine step")
    m.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    m.add_argument(
        "--device",
        choices=DEVICES,
        default=d.device,
        help="auto: cuda when the cluster has GPUs (default %(default)s)",
    )

    s = parser.add_argument_group("replicas and routing")
    s.add_argument(
        "--num-replicas",
        type=int,
        default=d.num_replicas,
        help="engine replicas (default %(default)s; ignored with autoscaling)",
    )
    s.add_argument("--min-replicas", type=int, help="autoscaling lower bound (enables autoscaling)")
    s.add_argument("--max-replicas", type=int, help="autoscaling upper bound (enables autoscaling)")
    s.add_argument(
        "--target-ongoing-requests",
        type=int,
        default=d.target_ongoing_requests,
        help="autoscaling target per replica (default %(default)s)",
    )
    s.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=d.max_ongoing_requests,
        help="requests in flight per replica (default %(default)s)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="waiting requests per replica before HTTP 429 (default %(default)s)",
    )
    s.add_argument(
        "--request-router",
        choices=ROUTERS,
        default=d.request_router,
        help="replica choice: prefix-cache affinity + load, or Serve's "
        "power-of-two choices (default %(default)s)",
    )
    s.add_argument(
        "--stream-interval-ms",
        type=int,
        default=d.stream_interval_ms,
        help="most time a streamed token waits to travel with later ones; the wait grows "
        "with the replica's concurrent streams (about 3 ms per stream) up to this, trading "
        "chunk granularity for less per-token work on the HTTP path; 0: every token its own "
        "chunk (default %(default)s)",
    )
    s.add_argument(
        "--no-engine-process",
        action="store_true",
        help="run each replica's engine core on a thread of the replica instead of in a child "
        "process of its own (TP = 1; TP > 1 always uses a thread)",
    )
    s.add_argument(
        "--ingress-replicas",
        type=int,
        default=d.ingress_replicas,
        help="HTTP ingress replicas (default %(default)s)",
    )

    n = parser.add_argument_group("network")
    n.add_argument(
        "--host", default=default_host, help="HTTP/gRPC bind address (default %(default)s)"
    )
    n.add_argument(
        "--port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port (default %(default)s)"
    )
    n.add_argument(
        "--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port (default %(default)s)"
    )
    n.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Ray's metrics export port, scraped at /metrics (default %(default)s)",
    )
    n.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, if set)",
    )
    n.add_argument(
        "--api-key-env",
        default=d.api_key_env,
        help="env var holding the key on the cluster (default %(default)s)",
    )


def config_from_flags(args: argparse.Namespace) -> ServeConfig:
    """ServeConfig from parsed flags; raises ValueError naming a bad field."""
    return ServeConfig(
        model=os.path.abspath(args.model) if args.model else None,
        served_model_name=args.served_model_name,
        tensor_parallel_size=args.tensor_parallel_size,
        num_replicas=args.num_replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        max_queued_requests=args.max_queued_requests,
        api_key_env=args.api_key_env,
        device=args.device,
        ingress_replicas=args.ingress_replicas,
        request_router=args.request_router,
        stream_interval_ms=args.stream_interval_ms,
        engine_process=not args.no_engine_process,
    )


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key, else the env var named by --api-key-env (read now, at the edge)."""
    return args.api_key or os.environ.get(args.api_key_env) or None
