"""`kvray config`: write the Ray Serve config YAML that `serve deploy` (or a RayService) takes.

Same flags as `kvray serve`, but for those about the process `kvray serve` runs (--address,
--drain-timeout-s, --log-level: a YAML has no console), which it refuses. The API key itself
is never written: the YAML names the env var (`api_key_env`) the cluster must set. The
metrics port belongs to `ray start --metrics-export-port`, not to the Serve config; the
YAML's header says so.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cluster.cli.flags import add_serve_flags, api_key_from, config_from_flags
from cluster.config import ServeConfig

APP_NAME = "kvray"
IMPORT_PATH = "cluster.app:build_app"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # A YAML is for a cluster: listen on every interface unless told otherwise.
    add_serve_flags(parser, default_host="0.0.0.0")
    parser.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")


def serve_config(config: ServeConfig, host: str, port: int, grpc_port: int) -> dict[str, Any]:
    """The Serve config document (the schema `serve deploy` validates)."""
    from cluster.deploy.liveness import liveness_app_spec
    from cluster.grpc_api.ingress import grpc_options

    return {
        "proxy_location": "EveryNode",
        "http_options": http_options(config, host, port),
        # The gRPC ingress binds grpc_options.port itself (see cluster/grpc_api/ingress.py).
        "grpc_options": grpc_options(grpc_port),
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": config.to_args(),
            },
            # GET /health from a replica of its own (cluster/deploy/liveness.py).
            liveness_app_spec(APP_NAME, "/"),
        ],
    }


def render(doc: dict[str, Any], metrics_port: int, api_key_env: str) -> str:
    import yaml

    header = (
        "# kvray Serve application; deploy with `serve deploy FILE` (Ray cluster running).\n"
        f"# Metrics: start Ray with `ray start --metrics-export-port {metrics_port}`; scrape "
        "http://NODE:PORT/metrics.\n"
        f"# Auth: set {api_key_env} in the cluster's environment to require an API key.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_flags(args)
    except ValueError as err:
        print(f"kvray config: {err}", file=sys.stderr)
        return 2
    if api_key_from(args):
        print(
            "kvray config: the API key is not written to the YAML; set "
            f"{config.network.api_key_env} in the cluster's environment instead",
            file=sys.stderr,
        )
    doc = serve_config(config, args.host, args.port, args.grpc_port)
    text = render(doc, args.metrics_port, config.network.api_key_env)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def http_options(config: ServeConfig, host: str, port: int) -> dict[str, Any]:
    """Serve's http_options: where HTTP listens, and its TLS files when the config has them
    (Serve's own proxy terminates TLS; see cluster/deploy/serve_env.py)."""
    options: dict[str, Any] = {"host": host, "port": port}
    if config.network.tls:
        options |= {
            "ssl_certfile": config.network.tls_cert_file,
            "ssl_keyfile": config.network.tls_key_file,
        }
    return options
