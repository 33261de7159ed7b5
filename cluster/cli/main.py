"""`kvray` command line: serve | generate | run-batch | bench throughput | bench serve |
bench kernels | bench step | bench kv-tier | bench pd | bench spec-decode | config.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args)`;
this file only wires them together, and imports them lazily so `kvray --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cluster.config.network import DEFAULT_HTTP_PORT
from cluster.grpc_api.ingress import DEFAULT_GRPC_PORT

# (subcommand path, module, one-line help)
_COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("serve",), "cluster.cli.serve", "serve a model over HTTP (OpenAI API) and gRPC on Ray"),
    (("generate",), "cluster.cli.generate", "generate offline from a prompt, streaming to stdout"),
    (
        ("run-batch",),
        "cluster.cli.run_batch",
        "run a file of requests in OpenAI's batch format (JSONL), one result per line",
    ),
    (("config",), "cluster.cli.config", "write the Serve config YAML that `serve deploy` takes"),
    (
        ("bench", "throughput"),
        "cluster.bench.throughput.main",
        "offline throughput vs transformers",
    ),
    (("bench", "serve"), "cluster.bench.serve.main", "online latency/throughput against a server"),
    (
        ("bench", "kernels"),
        "cluster.bench.kernels.main",
        "the CPU kernels against torch's ops, per step size",
    ),
    (
        ("bench", "step"),
        "cluster.bench.step.main",
        "one engine step: time, ops, memory-bandwidth share",
    ),
    (
        ("bench", "kv-tier"),
        "cluster.bench.kv_tier.main",
        "the cluster KV tier: TTFT of a local hit, a peer pull, a recompute and a failover",
    ),
    (
        ("bench", "pd"),
        "cluster.bench.pd.main",
        "prefill/decode disaggregation against colocated replicas: one trace, latency, goodput",
    ),
    (
        ("bench", "spec-decode"),
        "cluster.bench.spec_decode.main",
        "speculative decoding off, fixed and adaptive: tokens/s per batch size and workload",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvray",
        description="kvray: LLM serving on Ray. Run `kvray serve` to serve the built-in demo "
        f"model on http://127.0.0.1:{DEFAULT_HTTP_PORT} (OpenAI API) and "
        f"127.0.0.1:{DEFAULT_GRPC_PORT} (gRPC).",
    )
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text in _COMMANDS:
        subs = top
        if len(path) == 2:
            if path[0] not in groups:
                group = top.add_parser(
                    path[0],
                    help="benchmarks (throughput | serve | kernels | step | kv-tier | pd | "
                    "spec-decode)",
                )
                groups[path[0]] = group.add_subparsers(
                    dest="subcommand", metavar="SUBCOMMAND", required=True
                )
            subs = groups[path[0]]
        p = subs.add_parser(path[-1], help=help_text, description=help_text)
        p.set_defaults(_module=module)
        _add_module_arguments(module, p)
    return parser


def _add_module_arguments(module: str, parser: argparse.ArgumentParser) -> None:
    importlib.import_module(module).add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc = importlib.import_module(args._module).run(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
