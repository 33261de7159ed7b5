"""`kvray serve`: start (or join) Ray, deploy the kvray application, serve until Ctrl-C/SIGTERM.

With no flags: a local Ray instance, the built-in demo model, HTTP on 127.0.0.1:8000 (OpenAI
API), gRPC on 127.0.0.1:9000, Ray metrics on :8080.

The console shows kvray's progress, the URLs, and warnings and errors; Ray's and Serve's INFO
lines go to their log files, whose directory it prints (--log-level, cluster/cli/console.py).

Start-up checks every port a local instance will bind (HTTP, gRPC, metrics, HAProxy's and
Serve's fallback proxy's) first: a taken one is a one-line error naming it and its holder,
exit 1; Serve's HAProxy left behind by a killed Ray instance is stopped (cluster/cli/ports.py).

Ctrl-C and SIGTERM (containers, systemd) stop the same way: first the HTTP ingress is told
to drain (a user_config change: /ready answers 503 and new requests get 503 at once), then
the application is deleted, so Serve takes its ingress replicas out of HAProxy and lets
in-flight requests finish, for up to --drain-timeout-s; then Serve and Ray stop, and any
HAProxy of this instance still running is stopped. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import uuid

from cluster.cli.config import APP_NAME, http_options
from cluster.cli.console import (
    LOG_LEVEL_HELP,
    LOG_LEVELS,
    ConsoleLogging,
    console_logging,
    filter_forwarded_logs,
    quiet_serve_driver_logger,
    ray_logs_dir,
)
from cluster.cli.flags import add_serve_flags, api_key_from, config_from_flags
from cluster.cli.local_ray import init_local_ray
from cluster.cli.ports import (
    Listener,
    check_ports,
    haproxy_config_dir,
    serve_haproxies,
    stop_processes,
)
from cluster.cli.stop_signals import StartInterrupted, StopSignals, deploy
from cluster.config import ServeConfig
from cluster.deploy.serve_env import SERVE_ENV, apply_serve_env
from cluster.tracing import exporter_missing

logger = logging.getLogger("kvray.serve")

# How long shutting down waits for the ingress to turn draining before deleting the app.
DRAIN_NOTICE_TIMEOUT_S = 10.0
# Stopping an application interrupted while it deployed: its replicas serve nothing, but one
# still in its constructor stops only when Serve kills it (graceful_shutdown_timeout_s).
START_ABORT_TIMEOUT_S = 90.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "HTTP (OpenAI API): /v1/completions (echo and prompt logprobs for evaluation "
        "harnesses), /v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models, "
        "/tokenize, /detokenize, /health, /ready (and /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter with --enable-runtime-lora); gRPC: kvray.v1.LLMService "
        "(Generate, GenerateStream, Embed, Tokenize, ListModels, LoadLoraAdapter, "
        "UnloadLoraAdapter). LoRA adapters: docs/lora.md. Batch files: `kvray run-batch`. "
        "Details: docs/contracts.md."
    )
    add_serve_flags(parser, default_host="127.0.0.1")
    parser.add_argument(
        "--address",
        help="join an existing Ray cluster (e.g. 'auto' or HOST:6379) instead of starting one",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on Ctrl-C/SIGTERM, how long in-flight requests get to finish before the "
        "replicas are stopped (default %(default)s)",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help=LOG_LEVEL_HELP)


def run(args: argparse.Namespace) -> int:
    levels = console_logging(args.log_level)
    logging.basicConfig(
        level=max(levels.kvray, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kvray").setLevel(levels.kvray)
    try:
        config = config_from_flags(args)
    except ValueError as err:
        print(f"kvray serve: {err}", file=sys.stderr)
        return 2
    # A local Ray reads these files here (the adapters' content: when the ingress starts).
    missing = not args.address and (
        config.tenants.keys_file_missing() or config.lora.modules_missing()
    )
    if missing:
        print(f"kvray serve: {missing}", file=sys.stderr)
        return 2
    api_key = api_key_from(args)
    if not args.address:
        # Before anything imports ray.serve: this process starts the local Serve instance and
        # every Ray process inherits its environment.
        apply_serve_env(
            tls=config.network.tls, taken=(args.port, args.grpc_port, args.metrics_port)
        )
        # The replicas of a local Ray run this Python: tracing's exporter must be here.
        problem = exporter_missing(config) or check_ports(local_listeners(args))
        if problem:
            print(f"kvray serve: {problem}", file=sys.stderr)
            return 1
    # From here on a signal is only recorded; each step checks it (cluster/cli/stop_signals.py).
    signals = StopSignals()
    signals.install()
    # This process's deployments keep one code version, so the drain notice reconfigures them.
    code_version = uuid.uuid4().hex
    try:
        start(config, args, api_key, code_version, signals)
    except StartInterrupted:  # Ctrl-C or SIGTERM while Ray starts or the application deploys
        logger.info("interrupted while starting: stopping")
        shutdown(args.address, drain_timeout_s=0.0)
        return 130
    except Exception as err:
        logger.error("could not start kvray: %s", err)
        shutdown(args.address, drain_timeout_s=0.0)
        return 1
    auth = api_key is not None or config.tenants.api_keys_file is not None
    print(banner(config, args, auth, ray_logs_dir()), flush=True)
    while not signals.wait(1.0):
        pass
    logger.info(
        "signal received: refusing new requests, in-flight ones get up to %.0f s to finish",
        args.drain_timeout_s,
    )
    if args.drain_timeout_s > 0:
        _announce_draining(config, code_version)
    shutdown(args.address, drain_timeout_s=args.drain_timeout_s)
    logger.info("stopped")
    return 0


def local_listeners(args: argparse.Namespace) -> list[Listener]:
    """The ports a local instance binds (Serve's own from the environment apply_serve_env
    set: HAProxy's only when HAProxy is on)."""
    ports = [
        Listener("HTTP", args.port),
        Listener("gRPC", args.grpc_port),
        Listener("metrics", args.metrics_port),
        Listener("Serve fallback proxy HTTP", _env_port("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")),
        Listener("Serve fallback proxy gRPC", _env_port("RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")),
    ]
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        ports.append(Listener("HAProxy stats", _env_port("RAY_SERVE_HAPROXY_STATS_PORT")))
        ports.append(Listener("HAProxy metrics", _env_port("RAY_SERVE_HAPROXY_METRICS_PORT")))
    return ports


def _env_port(key: str) -> int:
    return int(os.environ[key])


def start(
    config: ServeConfig,
    args: argparse.Namespace,
    api_key: str | None,
    code_version: str,
    signals: StopSignals,
) -> None:
    import ray
    from ray import serve

    from cluster.deploy.app import build_run_app
    from cluster.deploy.liveness import liveness_target

    levels = console_logging(args.log_level)
    runtime_env = {}
    if api_key:
        # Local Ray workers inherit the driver's environment; a joined cluster gets the key
        # through the job's runtime env (never through the Serve config).
        os.environ[config.network.api_key_env] = api_key
        runtime_env = {"env_vars": {config.network.api_key_env: api_key}}
    if args.address:
        logger.info("joining the Ray cluster at %s", args.address)
        logger.info(
            "for the fast streaming path, start that cluster with these env vars: %s",
            " ".join(f"{k}={v}" for k, v in SERVE_ENV.items()),
        )
        ray.init(
            address=args.address, runtime_env=runtime_env or None, logging_level=levels.ray_driver
        )
        signals.install()  # ray.init installed its own SIGTERM handler
    else:
        # Each engine replica reserves one CPU per TP rank; a small machine still runs them.
        replicas = (
            config.autoscaling.max_replicas
            or config.autoscaling.min_replicas
            or config.replicas.num_replicas
        )
        cpus = max(os.cpu_count() or 1, replicas * config.engine.tensor_parallel_size + 1)
        logger.info(
            "starting a local Ray instance (%d logical CPUs, metrics export port %d)",
            cpus,
            args.metrics_port,
        )
        init_local_ray(
            address="local",  # a new instance, never one another `ray start` left running
            num_cpus=cpus,
            include_dashboard=False,
            runtime_env=runtime_env or None,
            logging_level=levels.ray_driver,
            _metrics_export_port=args.metrics_port,
        )
        signals.install()  # ray.init installed its own SIGTERM handler
    signals.check()
    _quiet_ray(levels, joined=bool(args.address))
    if not args.address and config.engine.model is None:
        from workers.demo import demo_model_dir

        logger.info("preparing the built-in demo model")
        logger.info("demo model at %s", demo_model_dir())
    from cluster.grpc_api.ingress import grpc_options

    logger.info(
        "starting Ray Serve: HTTP %s:%d, gRPC port %d", args.host, args.port, args.grpc_port
    )
    # The gRPC ingress reads its port from here and binds it itself (cluster/grpc_api/ingress.py).
    serve.start(
        http_options=http_options(config, args.host, args.port),
        grpc_options=grpc_options(args.grpc_port),
    )
    logger.info(
        "deploying %s: %s replica(s) of LLMServer (tp=%d), router %s",
        config.engine.model_name(),
        _replica_text(config),
        config.engine.tensor_parallel_size,
        config.replicas.request_router,
    )
    signals.check()
    t0 = time.monotonic()
    app = serve.RunTarget(build_run_app(config, code_version), name=APP_NAME, route_prefix="/")
    # GET /health from its own replica, so the liveness probe answers under any load.
    deploy([app, liveness_target(APP_NAME, "/")], signals)
    logger.info("application ready in %.1f s", time.monotonic() - t0)


def _quiet_ray(levels: ConsoleLogging, joined: bool) -> None:
    """Ray's and Serve's lines below the console's level go to their log files only."""
    logs_dir = ray_logs_dir()
    where = " (on each node of the cluster)" if joined else ""
    logger.info("Ray and Serve logs: %s%s; --log-level debug shows them here", logs_dir, where)
    if not filter_forwarded_logs(levels.forwarded):
        logger.warning("could not filter Ray's forwarded logs: all of them show here")
    quiet_serve_driver_logger(levels, logs_dir)


def banner(
    config: ServeConfig, args: argparse.Namespace, auth: bool, logs_dir: str | None = None
) -> str:
    host = args.host
    base = f"{'https' if config.network.tls else 'http'}://{host}:{args.port}"
    auth_header = f' -H "Authorization: Bearer ${config.network.api_key_env}"' if auth else ""
    model = config.engine.model_name()
    body = f'{{"model": "{model}", "prompt": "Once upon a time", "max_tokens": 32}}'
    lines = [
        f"kvray is serving {model} ({_replica_text(config)} replica(s))",
        f"  OpenAI API : {base}/v1   (health: {base}/health)",
    ]
    lines += [
        f"  gRPC       : {host}:{args.grpc_port}{' (TLS)' if config.network.tls else ''}   "
        "(kvray.v1.LLMService, grpc.health.v1)",
        f"  metrics    : http://{host}:{args.metrics_port}/metrics",
        f"  auth       : {'Bearer key required' if auth else 'off'}",
    ]
    if logs_dir:
        lines.append(f"  logs       : {logs_dir}   (Ray's and Serve's; --log-level debug: here)")
    lines += [
        "  try:",
        f"    curl {base}/v1/completions -H 'Content-Type: application/json'{auth_header} \\",
        f"      -d '{body}'",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)


def _replica_text(config: ServeConfig) -> str:
    auto = config.autoscaling_config()
    n = (
        f"{auto['min_replicas']}-{auto['max_replicas']}"
        if auto
        else str(config.replicas.num_replicas)
    )
    pd = config.pd
    if pd.prefill_replicas:  # docs/disaggregation.md
        hi = pd.prefill_max_replicas
        m = f"{pd.prefill_replicas}-{hi}" if hi is not None else str(pd.prefill_replicas)
        return f"{n} decode + {m} prefill (--pd {pd.pd})"
    return n


def shutdown(address: str | None, drain_timeout_s: float) -> None:
    import ray
    from ray import serve

    from cluster.deploy.liveness import liveness_app_name
    from cluster.ingress.lora_registry import delete_registry
    from cluster.replica.kv_directory import delete_directory

    if not ray.is_initialized():
        return
    node_id = ray.get_runtime_context().get_node_id()
    try:
        if address:  # a shared cluster keeps Serve and its other apps
            if drain_timeout_s > 0:
                _drain(drain_timeout_s)  # Serve finishes deleting it if this times out
            else:
                _drain(START_ABORT_TIMEOUT_S)  # a replica still loading stops when Serve kills it
            serve.delete(liveness_app_name(APP_NAME))
            delete_registry(APP_NAME)  # its runtime LoRA adapters (a detached actor)
            delete_directory(APP_NAME)  # its cluster KV tier's objects (a detached actor)
        elif drain_timeout_s <= 0 or _drain(drain_timeout_s):
            serve.shutdown()  # no replicas left (once drained): stops the rest at once
    except Exception as err:  # shutting down anyway
        logger.warning("serve shutdown: %s", err)
    ray.shutdown()
    if not address:
        # An HAProxy whose manager was killed (drain timed out, or a crash) outlives Ray.
        left = serve_haproxies(os.path.join(haproxy_config_dir(), node_id))
        if left:
            logger.info("stopping %d HAProxy process(es) left by Serve", len(left))
            stop_processes(left)


def _announce_draining(config: ServeConfig, code_version: str) -> None:
    """Redeploys the application with its HTTP ingress draining: only the ingress's
    user_config changes and every deployment keeps the code version it was started with, so
    Serve reconfigures the running replicas (nothing restarts).
    Waits at most DRAIN_NOTICE_TIMEOUT_S: shutting down must not hang on it."""
    from ray import serve

    from cluster.deploy.app import build_run_app

    def redeploy() -> None:
        try:
            serve.run(
                build_run_app(config, code_version, draining=True), name=APP_NAME, route_prefix="/"
            )
        except Exception as err:  # shutting down anyway
            logger.warning("could not mark the ingress draining: %s", err)

    t0 = time.monotonic()
    worker = threading.Thread(target=redeploy, name="kvray-drain-notice", daemon=True)
    worker.start()
    worker.join(DRAIN_NOTICE_TIMEOUT_S)
    logger.info("ingress draining (/ready 503) after %.1f s", time.monotonic() - t0)


def _drain(timeout_s: float) -> bool:
    """Deletes the application and waits up to timeout_s for Serve to finish that: HAProxy
    stops routing to its replicas at once, each replica finishes its in-flight requests
    (up to its graceful_shutdown_timeout_s). Whether the application is gone."""
    from ray import serve

    serve.delete(APP_NAME, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while APP_NAME in serve.status().applications:
        if time.monotonic() >= deadline:
            logger.warning("drain timeout (%.0f s): stopping the replicas now", timeout_s)
            return False
        time.sleep(0.5)
    return True
