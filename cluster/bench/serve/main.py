"""`kvray bench serve`: online latency and throughput, in the style of `vllm bench serve`.

    kvray bench serve --base-url http://127.0.0.1:8000            # against a running server
    kvray bench serve --backend inprocess,http --launch           # side by side, one command
    kvray bench serve --launch --num-replicas 2 --workload shared-prefix \\
        --request-router prefix_affinity,power_of_two             # router vs router
    kvray bench serve --launch --num-replicas 2 --overload 2000   # a burst far past the caps
    kvray bench serve --launch --num-replicas 2 --fault-at 10     # kill the busiest engine
    kvray bench serve --launch --num-replicas 2 --chaos 600       # faults under a mixed load
    kvray bench serve --launch --workload json-schema --rounds 3  # constrained vs free text
    kvray bench serve --launch --workload lora --num-adapters 16   # adapters vs base model

Requests are streaming completions with token-id prompts, ignore_eos and max_tokens, so every
backend does exactly the same work. Arrivals are Poisson at --request-rate (inf: all at once),
capped at --max-concurrency in flight. Reported per run: TTFT, TPOT, ITL and E2E latency
(mean, median, p99), request and token throughput, and the prefix-cache hit rate (cached
prompt tokens from each response's usage / prompt tokens). Each backend's prompts start with
a token of its own (serve/salt.py): backends measured one after another on one server each
start with none of their prompts in its prefix cache, and do the same work.

--launch starts a local Ray instance and deploys the kvray app itself (once per router in
--request-router); `inprocess` runs first, before Ray starts, so the two never share the CPU.

This module runs the command; the workloads are in workload.py, the statistics and the report
in report.py, the --overload mode (status counts, /health latency from another process, drain
time) in overload.py, --workload json-schema (constrained vs unconstrained twins) in
structured.py, --workload lora (adapters vs the base model) in lora.py; the --launch cluster
in common/launch.py, the backends in common/backends.py, --fault-at (kill a replica mid-run)
in fault/main.py, --chaos (faults at random, mixed workload) in chaos/main.py (cluster/bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster.bench.chaos import main as chaos
from cluster.bench.common import launch
from cluster.bench.common.backends import BACKENDS, BackendContext, RequestRecord, open_backend
from cluster.bench.common.launch import (
    LocalCluster,
    server_context,
    with_server_defaults,
)
from cluster.bench.common.result import write_result_json
from cluster.bench.common.workload import (
    BenchRequest,
    Workload,
    sampleable_token_ids,
    warmup_workload,
)
from cluster.bench.fault import main as fault
from cluster.bench.serve import lora as serve_lora
from cluster.bench.serve import overload, overload_command
from cluster.bench.serve.cpu import cpu_seconds_by_role, ms_per_token
from cluster.bench.serve.report import compare, format_report, summarize, summary_line
from cluster.bench.serve.salt import salt_workload
from cluster.bench.serve.workload import build_workload
from cluster.config import ServeConfig
from cluster.config.replicas import ROUTERS
from cluster.deploy.serve_env import apply_serve_env
from cluster.grpc_api.ingress import DEFAULT_GRPC_PORT

_DEFAULTS = ServeConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--backend", default="http", help=f"comma list of {', '.join(BACKENDS)} (default: http)")
    a("--base-url", default=None, help="server to benchmark, e.g. http://127.0.0.1:8000")
    a(
        "--grpc-address",
        default=None,
        help=f"grpc backend: HOST:PORT (default: base-url host:{DEFAULT_GRPC_PORT})",
    )
    a("--api-key", default=None, help="Bearer key for the server")
    a("--model", default=None, help="checkpoint dir for the tokenizer / inprocess engine (demo)")
    a("--served-model-name", default=None, help="model id in requests (default: the server's)")
    a(
        "--workload",
        choices=("random", "shared-prefix", "tenants-zipf", "json-schema", "lora"),
        default="random",
        help="shared-prefix: --num-tenants system prompts, each equally likely; tenants-zipf: "
        "the same with Zipf popularity (--zipf-s); json-schema: each round, the same prompts "
        "with and without response_format json_schema; reports constrained/unconstrained; "
        "lora: the same prompts on the base model, then naming --num-adapters LoRA adapters",
    )
    a("--num-prompts", type=int, default=200)
    a("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    a("--max-concurrency", type=int, default=None, help="requests in flight at most")
    a("--input-len", type=int, default=128, help="prompt tokens per request")
    a("--output-len", type=int, default=64, help="output tokens per request")
    a("--num-tenants", type=int, default=4, help="tenant workloads: distinct system prompts")
    a("--prefix-len", type=int, default=96, help="tenant workloads: tokens of each system prompt")
    a("--zipf-s", type=float, default=1.0, help="tenants-zipf: P(tenant k) ~ 1/k^s (tenants.py)")
    a("--seed", type=int, default=0)
    a("--warmup-requests", type=int, default=4)
    a(
        "--rounds",
        type=int,
        default=1,
        help="measure each backend this many times, alternating backends within a round (each "
        "round its own prompts); comparisons report the median over rounds, so drift in a "
        "shared machine's load hits both sides (default 1)",
    )
    a(
        "--inprocess-threads",
        type=int,
        default=1,
        help="inprocess: torch threads; default 1 = what Ray gives a CPU replica (OMP_NUM_THREADS "
        "= its reserved CPUs), so both run the same engine; 0 = torch's default",
    )
    a("--result-json", default=None, metavar="FILE")
    launch.add_arguments(parser)
    overload.add_arguments(parser)
    fault.add_arguments(parser)
    chaos.add_arguments(parser)
    serve_lora.add_arguments(parser)


def _usage_error(args: argparse.Namespace, backends: list[str], bad: list[str]) -> str | None:
    """What is wrong with the command line before anything starts, or None."""
    if bad:
        return f"unknown backend/router {bad}"
    if not args.launch and not args.base_url and set(backends) - {"inprocess"}:
        return "give --base-url or --launch"
    if args.overload and backends != ["http"]:
        return "--overload runs over the http backend only"
    if args.rounds < 1:
        return "--rounds must be >= 1"
    return launch.launch_error(args) if args.launch else None


def run(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    routers = [r.strip() for r in args.request_router.split(",") if r.strip()]
    bad = [b for b in backends if b not in BACKENDS] + [r for r in routers if r not in ROUTERS]
    error = _usage_error(args, backends, bad)
    if error is not None:
        print(f"kvray bench serve: {error}", file=sys.stderr)
        return 2
    model_dir = Path(args.model) if args.model else _demo_dir()
    token_ids = sampleable_token_ids(model_dir)
    if args.chaos is not None:
        return chaos.run_command(args, model_dir, token_ids)
    if args.overload:
        return overload_command.run_command(args, model_dir, token_ids)
    if args.fault_at is not None:
        return fault.run_command(args, model_dir, token_ids)
    # Round r's prompts: seed + r, so no round is served from the previous one's prefix cache.
    workloads = [
        build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + r}), token_ids)
        for r in range(args.rounds)
    ]
    workload = workloads[0]
    warmup = warmup_workload(token_ids, seed=args.seed, num=args.warmup_requests)
    print(
        f"kvray bench serve: workload {workload.name}, {len(workload.requests)} requests, "
        f"{workload.prompt_tokens} prompt + {workload.output_tokens} output tokens, "
        f"rate {args.request_rate}, max concurrency {args.max_concurrency}, "
        f"{args.rounds} round(s)"
    )
    if args.launch:
        # As `kvray serve` runs it; before anything imports ray.serve in this process.
        apply_serve_env()
    adapters = serve_lora.prepare_adapters(args, model_dir) if args.workload == "lora" else {}
    summaries = asyncio.run(
        _run_all(args, backends, routers, model_dir, workloads, warmup, token_ids, adapters)
    )
    comparisons = compare(summaries)
    print()
    print(format_report(summaries, comparisons))
    if args.workload == "json-schema":
        from cluster.bench.serve.structured import compare_structured, format_structured

        comparisons["json_schema_vs_unconstrained"] = compare_structured(summaries)
        print(format_structured(comparisons["json_schema_vs_unconstrained"]))
    if args.workload == "lora":
        comparisons["lora_vs_base"] = serve_lora.compare_lora(summaries)
        print(serve_lora.format_lora(summaries, comparisons["lora_vs_base"]))
    if args.workload == "tenants-zipf":
        from cluster.bench.serve.tenants import router_cpu_us

        cpu = router_cpu_us(workload, _DEFAULTS.engine.block_size, args.num_replicas)
        print(
            "router CPU per decision (in-process replay): "
            + ", ".join(f"{k} {v:.0f} us" for k, v in cpu.items())
        )
    if args.result_json:
        write_result_json(
            args.result_json,
            {"workload": workload.describe(), "runs": summaries, "comparisons": comparisons},
        )
        print(f"\nwrote {args.result_json}")
    return 0 if summaries and all(s["completed"] for s in summaries) else 1


# -- running ----------------------------------------------------------------------------------


async def run_workload(
    backend: Any, workload: Workload, request_rate: float, max_concurrency: int | None, seed: int
) -> tuple[list[RequestRecord], float]:
    """Sends every request (Poisson arrivals, bounded concurrency); (records, wall seconds)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)

    async def one(req: BenchRequest) -> RequestRecord:
        if sem is None:
            return await backend.send(req)
        async with sem:
            return await backend.send(req)

    start = time.perf_counter()
    tasks = []
    for req in workload.requests:
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(request_rate) and request_rate > 0:
            await asyncio.sleep(rng.expovariate(request_rate))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


async def open_warm(
    name: str, ctx: BackendContext, args: argparse.Namespace, warmup: Workload
) -> Any:
    """An opened backend that has served the warm-up requests (first calls are slow)."""
    backend = await open_backend(name, ctx)
    try:
        await run_workload(backend, warmup, math.inf, None, args.seed)
    except BaseException:
        await backend.close()
        raise
    return backend


async def measure(
    label: str, backend: Any, args: argparse.Namespace, workload: Workload, round_: int
) -> dict[str, Any]:
    print(
        f"running {label}" + (f" (round {round_ + 1})" if args.rounds > 1 else "") + " ...",
        flush=True,
    )
    cpu_before = cpu_seconds_by_role()
    records, elapsed = await run_workload(
        backend, workload, args.request_rate, args.max_concurrency, args.seed
    )
    summary = summarize(label, records, elapsed)
    summary["round"] = round_
    # Every local process's CPU, not only this backend's: with --launch an idle app still
    # spends some (Serve's controller, Ray's agents), which the in-process rows then show.
    summary["cpu_ms_per_output_token"] = ms_per_token(
        cpu_before, cpu_seconds_by_role(), summary["output_tokens"]
    )
    print(summary_line(summary), flush=True)
    return summary


async def _run_all(
    args: argparse.Namespace,
    backends: list[str],
    routers: list[str],
    model_dir: Path,
    workloads: Sequence[Workload],
    warmup: Workload,
    token_ids: Sequence[int],
    adapters: dict[str, str],
) -> list[dict[str, Any]]:
    engine_kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if args.kv_cache_memory:
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory
    engine_kwargs |= serve_lora.engine_overrides(args, adapters)
    base = replace(
        server_context(args, model_dir),
        engine_kwargs=engine_kwargs,
        torch_threads=args.inprocess_threads,
        lora_modules=adapters,
    )
    remote = [b for b in backends if b != "inprocess"]
    async with contextlib.AsyncExitStack() as stack:
        inprocess = None
        if "inprocess" in backends:
            inprocess = await open_warm("inprocess", base, args, warmup)
            stack.push_async_callback(inprocess.close)
        if not remote:
            return await _rounds(args, workloads, token_ids, inprocess, [])
        if not args.launch:
            ctx = await with_server_defaults(base)
            opened = await _open_all(stack, remote, ctx, args, warmup, lambda n: n)
            return await _rounds(args, workloads, token_ids, inprocess, opened)
        summaries = []
        lora = serve_lora.server_overrides(args, adapters)
        cluster = stack.enter_context(LocalCluster(args, _max_queued(workloads, warmup), lora))
        for router in routers:
            ctx = await asyncio.to_thread(cluster.deploy, router, base)
            async with contextlib.AsyncExitStack() as per_router:
                opened = await _open_all(
                    per_router,
                    remote,
                    ctx,
                    args,
                    warmup,
                    lambda n, r=router: f"{n}[{r}]" if len(routers) > 1 else n,
                )
                summaries += await _rounds(
                    args, workloads, token_ids, inprocess, opened, group=router
                )
            await asyncio.to_thread(cluster.undeploy)
        return summaries


def _max_queued(workloads: Sequence[Workload], warmup: Workload) -> int:
    return max(len(w.requests) for w in workloads) + len(warmup.requests)


async def _open_all(
    stack: contextlib.AsyncExitStack,
    names: Sequence[str],
    ctx: BackendContext,
    args: argparse.Namespace,
    warmup: Workload,
    label: Any,
) -> list[tuple[str, Any]]:
    opened = []
    for name in names:
        backend = await open_warm(name, ctx, args, warmup)
        stack.push_async_callback(backend.close)
        opened.append((label(name), backend))
    return opened


async def _rounds(
    args: argparse.Namespace,
    workloads: Sequence[Workload],
    token_ids: Sequence[int],
    inprocess: Any,
    opened: Sequence[tuple[str, Any]],
    group: str = "",
) -> list[dict[str, Any]]:
    """Every backend once per round, in the same order each round; `group` tells comparisons
    which in-process run a remote one is measured against (one per launched router). Each
    backend gets the round's workload salted with its own first token (salt_workload): the
    remote ones share a server, and a backend measured after another must not find its
    prompts in the prefix cache the other filled."""
    both = ([("inprocess", inprocess)] if inprocess is not None else []) + list(opened)
    if args.workload == "json-schema":
        from cluster.bench.serve.structured import structured_rounds

        return await structured_rounds(args, workloads, both, token_ids, measure, group)
    if args.workload == "lora":
        return await serve_lora.lora_rounds(args, workloads, both, token_ids, measure, group)
    summaries = []
    for r, workload in enumerate(workloads):
        for slot, (label, backend) in enumerate(both):
            salted = salt_workload(workload, slot, token_ids)
            summary = await measure(label, backend, args, salted, r)
            summary["group"] = group
            summaries.append(summary)
    return summaries


def _demo_dir() -> Path:
    from workers.demo import demo_model_dir

    return demo_model_dir()
