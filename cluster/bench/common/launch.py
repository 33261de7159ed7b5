"""`kvray bench serve --launch`: a local Ray instance running the kvray app on free ports."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

from cluster.bench.common.backend_types import BackendContext
from cluster.config import ServeConfig
from cluster.config.replicas import ROUTERS
from cluster.config.units import parse_size

_DEFAULTS = ServeConfig()
APP_NAME = "kvray-bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --launch flags: the local app's shape."""
    g = parser.add_argument_group("--launch: a local kvray app to benchmark")
    g.add_argument("--launch", action="store_true", help="start local Ray + the kvray app")
    g.add_argument("--num-replicas", type=int, default=_DEFAULTS.replicas.num_replicas)
    g.add_argument(
        "--request-router",
        default=_DEFAULTS.replicas.request_router,
        help=f"comma list of {', '.join(ROUTERS)}: one launched app each",
    )
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.engine.max_num_seqs)
    g.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=_DEFAULTS.replicas.num_cpus_per_replica,
        help="CPUs (torch threads) of each engine replica",
    )
    g.add_argument("--stream-interval-ms", type=int, default=_DEFAULTS.replicas.stream_interval_ms)
    g.add_argument("--kv-cache-memory", type=parse_size, default=None)
    g.add_argument(
        "--max-migrations",
        type=int,
        default=_DEFAULTS.replicas.max_migrations,
        help="requests' moves to another replica when theirs dies (0: off; see --fault-at)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="each replica's queue cap (default: the app's, or what the run queues at once)",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=None,
        help="requests Serve sends each replica at once (default as --max-queued-requests)",
    )
    g.add_argument(
        "--no-engine-process",
        action="store_true",
        help="the replica's engine core on a thread, not in a child process",
    )


class LocalCluster:
    """--launch: a local Ray instance running the kvray app on free ports."""

    def __init__(
        self,
        args: argparse.Namespace,
        max_queued: int | None,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        """`max_queued`: requests the app must queue without refusing (never fewer than a
        served app's defaults); None keeps the app's default caps (the overload bench).
        `overrides`: other ServeConfig fields of the app (--chaos: how tenants are named)."""
        self._args = args
        self._overrides = dict(overrides or {})
        self._max_queued = (
            None if max_queued is None else max(_DEFAULTS.limits.max_queued_requests, max_queued)
        )

    def __enter__(self) -> LocalCluster:
        import ray
        from ray import serve

        from cluster.deploy.serve_env import LOCAL_PORT_KEYS, free_ports
        from cluster.grpc_api.ingress import grpc_options

        # Not the ports apply_serve_env chose for Serve's other listeners.
        serves = [int(os.environ[k]) for k in LOCAL_PORT_KEYS if k in os.environ]
        self.http_port, self.grpc_port = free_ports(2, taken=serves)
        ray.init(
            address="local",  # a new instance, never one another `ray start` left running
            num_cpus=max(4, round(self._args.num_replicas * self._args.num_cpus_per_replica) + 2),
            include_dashboard=False,
            logging_level="WARNING",
            # Every request logs a line in each replica; relayed here they would bury the
            # report and cost this (the client's) process CPU. Failed requests still show
            # their errors in the report.
            log_to_driver=False,
        )
        # Ray's default temp dir; session_latest points at this instance.
        print("local Ray started; replica logs in /tmp/ray/session_latest/logs/serve", flush=True)
        serve.start(
            http_options={"host": "127.0.0.1", "port": self.http_port},
            grpc_options=grpc_options(self.grpc_port),
        )
        return self

    def deploy(self, router: str, base: BackendContext) -> BackendContext:
        from dataclasses import replace

        from ray import serve

        from cluster.deploy.app import build_app
        from cluster.deploy.liveness import run_liveness_app

        caps = {}
        if self._max_queued is not None:
            # A latency benchmark measures load; it must not be turned away with 429s.
            caps = {
                "max_queued_requests": self._max_queued,
                "max_ongoing_requests": max(
                    _DEFAULTS.replicas.max_ongoing_requests, self._max_queued
                ),
            }
        # The caps the user gave win (--overload against a small app's caps).
        for key in ("max_queued_requests", "max_ongoing_requests"):
            if getattr(self._args, key, None) is not None:
                caps[key] = getattr(self._args, key)
        config = ServeConfig.from_flat(
            model=self._args.model,
            num_replicas=self._args.num_replicas,
            request_router=router,
            max_num_seqs=self._args.max_num_seqs,
            num_cpus_per_replica=self._args.num_cpus_per_replica,
            stream_interval_ms=self._args.stream_interval_ms,
            engine_process=not self._args.no_engine_process,
            kv_cache_memory_bytes=self._args.kv_cache_memory,
            max_migrations=self._args.max_migrations,
            **caps,
            **self._overrides,
        )
        print(f"deploying kvray ({config.replicas.num_replicas} replica(s), router {router}) ...")
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        run_liveness_app(APP_NAME, "/")
        return replace(
            base,
            model=config.engine.model_name(),
            base_url=f"http://127.0.0.1:{self.http_port}",
            grpc_address=f"127.0.0.1:{self.grpc_port}",
        )

    def undeploy(self) -> None:
        from ray import serve

        from cluster.deploy.liveness import liveness_app_name

        serve.delete(APP_NAME)
        serve.delete(liveness_app_name(APP_NAME))

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def launch_error(args: argparse.Namespace) -> str | None:
    """The --launch app's caps checked as its ServeConfig will check them, before Ray starts
    (a bad value would otherwise surface only at deploy, after the cluster is up); None when
    they are valid."""
    caps = {
        key: getattr(args, key)
        for key in ("max_queued_requests", "max_ongoing_requests")
        if getattr(args, key, None) is not None
    }
    try:
        ServeConfig.from_flat(num_replicas=args.num_replicas, **caps)
    except (TypeError, ValueError) as err:
        return str(err)
    return None


async def with_server_defaults(ctx: BackendContext) -> BackendContext:
    """Fills the model id (from /v1/models) and the gRPC address (base-url host, gRPC port)."""
    from dataclasses import replace
    from urllib.parse import urlparse

    from cluster.grpc_api.ingress import DEFAULT_GRPC_PORT

    model = ctx.model
    if not model and ctx.base_url:
        import aiohttp

        headers = {"Authorization": f"Bearer {ctx.api_key}"} if ctx.api_key else {}
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{ctx.base_url.rstrip('/')}/v1/models", headers=headers) as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
    grpc_address = ctx.grpc_address
    if grpc_address is None and ctx.base_url:
        grpc_address = f"{urlparse(ctx.base_url).hostname}:{DEFAULT_GRPC_PORT}"
    return replace(ctx, model=model, grpc_address=grpc_address)


def server_context(args: argparse.Namespace, model_dir: Path) -> BackendContext:
    """What the flags say of the server to benchmark (--served-model-name, --base-url,
    --grpc-address, --api-key); with_server_defaults fills in the rest."""
    return BackendContext(
        model=args.served_model_name or "",
        model_dir=str(model_dir),
        base_url=args.base_url,
        grpc_address=args.grpc_address,
        api_key=args.api_key,
    )


def single_app(
    args: argparse.Namespace,
    base: BackendContext,
    stack: contextlib.ExitStack,
    max_queued: int | None,
    overrides: dict[str, Any] | None = None,
) -> tuple[BackendContext, str | None]:
    """The one app a mode that needs Serve's handle (--overload, --fault-at, --chaos) runs
    against, and its Serve application name: launched here (--launch, closed with `stack`; the
    first of --request-router) or the server of --base-url / --app-name. `max_queued`,
    `overrides`: see LocalCluster (a server already running keeps its own config)."""
    if not args.launch:
        return asyncio.run(with_server_defaults(base)), args.app_name
    from cluster.deploy.serve_env import apply_serve_env

    apply_serve_env()  # as `kvray serve` runs it; before anything imports ray.serve
    cluster = stack.enter_context(LocalCluster(args, max_queued=max_queued, overrides=overrides))
    return cluster.deploy(args.request_router.split(",")[0].strip(), base), APP_NAME
