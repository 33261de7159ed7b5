"""`kvray bench serve`: online latency and throughput, in the style of `vllm bench serve`.

    kvray bench serve --base-url http://127.0.0.1:8000            # against a running server
    kvray bench serve --backend inprocess,http --launch           # side by side, one command
    kvray bench serve --launch --num-replicas 2 --workload shared-prefix \\
        --request-router prefix_affinity,power_of_two             # router vs router

Requests are streaming completions with token-id prompts, ignore_eos and max_tokens, so every
backend does exactly the same work. Arrivals are Poisson at --request-rate (inf: all at once),
capped at --max-concurrency in flight. Reported per run: TTFT, TPOT, ITL and E2E latency
(mean, median, p99), request and token throughput, and the prefix-cache hit rate (cached
prompt tokens from each response's usage / prompt tokens).

--launch starts a local Ray instance and deploys the kvray app itself (once per router in
--request-router); `inprocess` runs first, before Ray starts, so the two never share the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.bench.backends import BACKENDS, BackendContext, RequestRecord, open_backend
from cluster.bench.common import (
    BenchRequest,
    Workload,
    parse_size,
    random_workload,
    sampleable_token_ids,
    warmup_workload,
    write_result_json,
)
from cluster.bench.cpu import cpu_seconds_by_role, ms_per_token
from cluster.config import ROUTERS, ServeConfig
from cluster.serve_env import apply_serve_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--backend", default="http", help=f"comma list of {', '.join(BACKENDS)} (default: http)")
    a("--base-url", default=None, help="server to benchmark, e.g. http://127.0.0.1:8000")
    a("--grpc-address", default=None, help="grpc backend: HOST:PORT (default: base-url host:9000)")
    a("--api-key", default=None, help="Bearer key for the server")
    a("--model", default=None, help="checkpoint dir for the tokenizer / inprocess engine (demo)")
    a("--served-model-name", default=None, help="model id in requests (default: the server's)")
    a("--workload", choices=("random", "shared-prefix"), default="random")
    a("--num-prompts", type=int, default=200)
    a("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    a("--max-concurrency", type=int, default=None, help="requests in flight at most")
    a("--input-len", type=int, default=128, help="prompt tokens per request")
    a("--output-len", type=int, default=64, help="output tokens per request")
    a("--num-tenants", type=int, default=4, help="shared-prefix: distinct shared prefixes")
    a("--prefix-len", type=int, default=96, help="shared-prefix: tokens of each tenant's prefix")
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
    g = parser.add_argument_group("--launch: a local kvray app to benchmark")
    g.add_argument("--launch", action="store_true", help="start local Ray + the kvray app")
    g.add_argument("--num-replicas", type=int, default=1)
    g.add_argument(
        "--request-router",
        default="prefix_affinity",
        help=f"comma list of {', '.join(ROUTERS)}: one launched app each",
    )
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--stream-interval-ms", type=int, default=ServeConfig().stream_interval_ms)
    g.add_argument("--kv-cache-memory", type=parse_size, default=None)
    g.add_argument(
        "--no-engine-process",
        action="store_true",
        help="the replica's engine core on a thread, not in a child process",
    )


def run(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    routers = [r.strip() for r in args.request_router.split(",") if r.strip()]
    bad = [b for b in backends if b not in BACKENDS] + [r for r in routers if r not in ROUTERS]
    if bad:
        print(f"kvray bench serve: unknown backend/router {bad}", file=sys.stderr)
        return 2
    if not args.launch and not args.base_url and set(backends) - {"inprocess"}:
        print("kvray bench serve: give --base-url or --launch", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("kvray bench serve: --rounds must be >= 1", file=sys.stderr)
        return 2
    model_dir = Path(args.model) if args.model else _demo_dir()
    token_ids = sampleable_token_ids(model_dir)
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
    summaries = asyncio.run(_run_all(args, backends, routers, model_dir, workloads, warmup))
    comparisons = compare(summaries)
    print()
    print(format_report(summaries, comparisons))
    if args.result_json:
        write_result_json(
            args.result_json,
            {"workload": workload.describe(), "runs": summaries, "comparisons": comparisons},
        )
        print(f"\nwrote {args.result_json}")
    return 0 if summaries and all(s["completed"] for s in summaries) else 1


# -- workloads --------------------------------------------------------------------------------


def build_workload(args: argparse.Namespace, token_ids: Sequence[int]) -> Workload:
    if args.workload == "shared-prefix":
        return tenant_workload(
            token_ids,
            num_prompts=args.num_prompts,
            num_tenants=args.num_tenants,
            prefix_len=args.prefix_len,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
        )
    w = random_workload(
        token_ids,
        num_prompts=args.num_prompts,
        input_len_range=(args.input_len, args.input_len),
        output_len_range=(args.output_len, args.output_len),
        seed=args.seed,
    )
    return Workload("random", w.requests, w.params)


def tenant_workload(
    token_ids: Sequence[int],
    *,
    num_prompts: int,
    num_tenants: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    seed: int,
) -> Workload:
    """Multi-tenant shared prefixes: each tenant has its own system prompt (prefix_len tokens);
    each request = a random tenant's prefix + its own random suffix, input_len tokens in all."""
    if num_tenants < 1 or not 0 < prefix_len < input_len or output_len < 1:
        raise ValueError(
            "need --num-tenants >= 1, 0 < --prefix-len < --input-len, --output-len >= 1"
        )
    rng = random.Random(seed)
    prefixes = [tuple(rng.choices(token_ids, k=prefix_len)) for _ in range(num_tenants)]
    requests = tuple(
        BenchRequest(
            prefixes[rng.randrange(num_tenants)]
            + tuple(rng.choices(token_ids, k=input_len - prefix_len)),
            output_len,
        )
        for _ in range(num_prompts)
    )
    params = {
        "num_tenants": num_tenants,
        "prefix_len": prefix_len,
        "input_len": input_len,
        "output_len": output_len,
        "seed": seed,
    }
    return Workload("shared-prefix", requests, params)


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
) -> list[dict[str, Any]]:
    engine_kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if args.kv_cache_memory:
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory
    base = BackendContext(
        model=args.served_model_name or "",
        model_dir=str(model_dir),
        base_url=args.base_url,
        grpc_address=args.grpc_address,
        api_key=args.api_key,
        engine_kwargs=engine_kwargs,
        torch_threads=args.inprocess_threads,
    )
    remote = [b for b in backends if b != "inprocess"]
    async with contextlib.AsyncExitStack() as stack:
        inprocess = None
        if "inprocess" in backends:
            inprocess = await open_warm("inprocess", base, args, warmup)
            stack.push_async_callback(inprocess.close)
        if not remote:
            return await _rounds(args, workloads, inprocess, [])
        if not args.launch:
            ctx = await _with_server_defaults(base)
            opened = await _open_all(stack, remote, ctx, args, warmup, lambda n: n)
            return await _rounds(args, workloads, inprocess, opened)
        summaries = []
        cluster = stack.enter_context(LocalCluster(args, _max_queued(workloads, warmup)))
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
                summaries += await _rounds(args, workloads, inprocess, opened, group=router)
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
    inprocess: Any,
    opened: Sequence[tuple[str, Any]],
    group: str = "",
) -> list[dict[str, Any]]:
    """Every backend once per round, in the same order each round; `group` tells comparisons
    which in-process run a remote one is measured against (one per launched router)."""
    both = ([("inprocess", inprocess)] if inprocess is not None else []) + list(opened)
    summaries = []
    for r, workload in enumerate(workloads):
        for label, backend in both:
            summary = await measure(label, backend, args, workload, r)
            summary["group"] = group
            summaries.append(summary)
    return summaries


async def _with_server_defaults(ctx: BackendContext) -> BackendContext:
    """Fills the model id (from /v1/models) and the gRPC address (base-url host, port 9000)."""
    from dataclasses import replace
    from urllib.parse import urlparse

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
        grpc_address = f"{urlparse(ctx.base_url).hostname}:9000"
    return replace(ctx, model=model, grpc_address=grpc_address)


class LocalCluster:
    """--launch: a local Ray instance running the kvray app on free ports."""

    def __init__(self, args: argparse.Namespace, max_queued: int) -> None:
        self._args = args
        self._max_queued = max(128, max_queued)

    def __enter__(self) -> LocalCluster:
        import ray
        from ray import serve

        from cluster.grpc_api.ingress import grpc_options

        self.http_port, self.grpc_port = _free_port(), _free_port()
        ray.init(
            address="local",  # a new instance, never one another `ray start` left running
            num_cpus=max(4, self._args.num_replicas + 2),
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

        from cluster.app import build_app

        config = ServeConfig(
            model=self._args.model,
            num_replicas=self._args.num_replicas,
            request_router=router,
            max_num_seqs=self._args.max_num_seqs,
            stream_interval_ms=self._args.stream_interval_ms,
            engine_process=not self._args.no_engine_process,
            kv_cache_memory_bytes=self._args.kv_cache_memory,
            # A benchmark measures latency under load; it must not be turned away with 429s.
            max_queued_requests=self._max_queued,
            max_ongoing_requests=max(256, self._max_queued),
        )
        print(f"deploying kvray ({config.num_replicas} replica(s), router {router}) ...")
        serve.run(build_app(config), name="kvray-bench", route_prefix="/")
        return replace(
            base,
            model=config.model_name(),
            base_url=f"http://127.0.0.1:{self.http_port}",
            grpc_address=f"127.0.0.1:{self.grpc_port}",
        )

    def undeploy(self) -> None:
        from ray import serve

        serve.delete("kvray-bench")

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


# -- reporting --------------------------------------------------------------------------------


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "mean": 1000 * statistics.fmean(ordered),
        "median": 1000 * statistics.median(ordered),
        "p99": 1000 * p99,
    }


def summarize(backend: str, records: Sequence[RequestRecord], elapsed: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_len for r in ok)
    output = sum(r.output_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    errors = sorted({r.error for r in records if not r.ok})
    return {
        "backend": backend,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors[:5],
        "duration_s": elapsed,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": output / elapsed,
        "total_token_throughput": (prompt + output) / elapsed,
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }


def summary_line(s: dict[str, Any]) -> str:
    return (
        f"  {s['backend']}: {s['completed']} ok / {s['failed']} failed in {s['duration_s']:.2f} s, "
        f"{s['output_throughput']:.1f} output tok/s, TTFT median {s['ttft_ms']['median']:.1f} ms, "
        f"prefix-cache hit rate {s['prefix_cache_hit_rate']:.1%}"
        + (f", errors: {s['errors']}" if s["errors"] else "")
    )


def compare(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets (each backend vs the in-process run of the same round, median over
    rounds) and router vs router prefix-cache hit rates."""
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for s in summaries:
        rounds.setdefault((s.get("group", ""), s.get("round", 0)), []).append(s)
    ratios: dict[str, list[float]] = {}
    overheads: dict[str, list[float]] = {}
    for same in rounds.values():
        base = next((s for s in same if s["backend"] == "inprocess"), None)
        if base is None or not base["output_throughput"]:
            continue
        for s in same:
            if s is not base:
                name = f"{s['backend']} vs inprocess"
                ratios.setdefault(name, []).append(
                    s["output_throughput"] / base["output_throughput"]
                )
                overheads.setdefault(name, []).append(
                    s["ttft_ms"]["median"] - base["ttft_ms"]["median"]
                )
    out: dict[str, Any] = {
        name: {
            "output_throughput_ratio": statistics.median(ratios[name]),
            "median_ttft_overhead_ms": statistics.median(overheads[name]),
            "rounds": len(ratios[name]),
            "output_throughput_ratios": ratios[name],
            "median_ttft_overheads_ms": overheads[name],
        }
        for name in ratios
    }
    hit_rates: dict[str, list[float]] = {}
    for s in summaries:
        if "[" in s["backend"]:
            hit_rates.setdefault(s["backend"], []).append(s["prefix_cache_hit_rate"])
    if len(hit_rates) > 1:
        out["prefix_cache_hit_rate"] = {k: statistics.fmean(v) for k, v in hit_rates.items()}
    return out


def format_report(summaries: Sequence[dict[str, Any]], comparisons: dict[str, Any]) -> str:
    head = (
        f"{'backend':<28}{'req/s':>8}{'out tok/s':>11}{'TTFT mean/med/p99 ms':>24}"
        f"{'TPOT med ms':>13}{'ITL med/p99 ms':>17}{'E2E med/p99 ms':>18}{'hit rate':>10}"
    )
    rows = [head, "-" * len(head)]
    multi = any(s.get("round") for s in summaries)

    def label(s: dict[str, Any]) -> str:
        return s["backend"] + (f" r{s.get('round', 0) + 1}" if multi else "")

    for s in summaries:
        t, tp, i, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"]
        rows.append(
            f"{label(s):<28}{s['request_throughput']:>8.2f}{s['output_throughput']:>11.1f}"
            f"{t['mean']:>9.1f}/{t['median']:.1f}/{t['p99']:.1f}".ljust(71)
            + f"{tp['median']:>8.2f}{i['median']:>11.2f}/{i['p99']:.2f}"
            f"{e['median']:>11.1f}/{e['p99']:.1f}{s['prefix_cache_hit_rate']:>9.1%}"
        )
    cpu = [s for s in summaries if s.get("cpu_ms_per_output_token")]
    if cpu:
        rows.append("CPU ms per output token, by process (this machine's processes only):")
    for s in cpu:
        roles = s["cpu_ms_per_output_token"]
        rows.append(
            f"  {label(s):<26}{sum(roles.values()):6.2f} = "
            + ", ".join(f"{role} {ms:.2f}" for role, ms in roles.items())
        )
    for name, c in comparisons.items():
        if name == "prefix_cache_hit_rate":
            rows.append(
                "prefix-cache hit rate by router: "
                + ", ".join(f"{k} {v:.1%}" for k, v in c.items())
            )
        else:
            spread = ""
            if c["rounds"] > 1:
                lo, hi = min(c["output_throughput_ratios"]), max(c["output_throughput_ratios"])
                spread = f" (median of {c['rounds']} rounds, {lo:.2f}-{hi:.2f}x)"
            rows.append(
                f"{name}: output throughput {c['output_throughput_ratio']:.2f}x (target >= 0.85), "
                f"median TTFT overhead {c['median_ttft_overhead_ms']:+.1f} ms (target <= 10)"
                + spread
            )
    return "\n".join(rows)


def _demo_dir() -> Path:
    from workers.demo import demo_model_dir

    return demo_model_dir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
