"""`kvray bench serve --chaos DURATION_S`: a soak test that kills engines and replicas while a
mixed workload runs, and checks that nothing was lost and no output changed.

    kvray bench serve --launch --num-replicas 2 --chaos 600          # 10 minutes, 16 in flight
    kvray bench serve --launch --num-replicas 2 --chaos 300 --max-concurrency 32 \\
        --chaos-interval-s 10 --chaos-faults engine:1,replica:1 --chaos-tenants 4
    kvray bench serve --base-url URL --app-name APP --num-replicas 2 --chaos 60

For DURATION_S seconds, --max-concurrency workers (default 16) each send one request after
another over HTTP: the mix of chaos/workload.py (completions and chat, streamed or not, greedy
or seeded, a fifth constrained by a JSON schema; priorities and tenants from their flags; all
from --seed). Meanwhile faults hit random replicas at the times of a seeded schedule
(chaos/faults.py): SIGKILL of an engine process or of a replica actor. When the time is up the
workers stop sending and every request in flight is waited for (each at most
--chaos-request-timeout-s).

Then, with the served app shut down (--launch), the offline engine computes every completed
request's answer in this process (chaos/expected.py): greedy and seeded outputs must be the
same text, finish reason and token count, and structured ones valid JSON of their schema.
Reported (chaos/report.py): requests sent / completed / failed by status / lost, changed
outputs, TTFT and E2E per priority, each tenant's share, the faults and the migrations the
routers counted. The exit code is 0 only when nothing was lost and no output changed.

Needs the replicas on this machine and a Ray connection in this process (--launch, or a
test's session with --app-name), as --fault-at does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.bench.chaos.client import (
    ERROR,
    LOST,
    OK,
    ChaosClient,
    ChaosResult,
    TenantIdentity,
)
from cluster.bench.chaos.faults import (
    DEFAULT_FAULTS,
    Fault,
    Injector,
    PlannedFault,
    fault_schedule,
    parse_fault_weights,
)
from cluster.bench.chaos.metrics import metrics_urls, migrations_between, read_migrations
from cluster.bench.chaos.report import chaos_ok, format_chaos, summarize_chaos
from cluster.bench.chaos.workload import (
    DEFAULT_PRIORITIES,
    ChaosMix,
    describe_mix,
    parse_priorities,
    request_at,
)
from cluster.bench.common.backend_types import BackendContext
from cluster.bench.common.launch import server_context, single_app
from cluster.bench.common.result import write_result_json
from cluster.bench.serve.overload import stats_handle

DEFAULT_CONCURRENCY = 16
WARMUP_SEED_OFFSET = 7_919  # warm-up requests: their own seed, never the measured ones
PROGRESS_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "--chaos DURATION_S: kill engines and replicas at random under a mixed workload"
    )
    a = g.add_argument
    a(
        "--chaos",
        type=float,
        default=None,
        metavar="DURATION_S",
        help="run the mixed workload for DURATION_S seconds at --max-concurrency (default "
        f"{DEFAULT_CONCURRENCY}) while faults hit random replicas; report lost requests and "
        "changed outputs (needs --launch or --app-name)",
    )
    a(
        "--chaos-interval-s",
        type=float,
        default=15.0,
        help="mean seconds between faults (exponential gaps drawn from --seed; default "
        "%(default)s)",
    )
    a(
        "--chaos-min-gap-s",
        type=float,
        default=1.0,
        help="shortest gap between two faults (default %(default)s)",
    )
    a(
        "--chaos-faults",
        default=DEFAULT_FAULTS,
        metavar="KIND:WEIGHT,...",
        help="fault kinds and their weights: engine (SIGKILL of a replica's engine process), "
        "replica (of its actor) (default %(default)s)",
    )
    a("--chaos-tenants", type=int, default=3, help="tenants sending requests (default %(default)s)")
    a(
        "--chaos-tenant-header",
        default="x-tenant-id",
        help="header naming each request's tenant (tenant-0, tenant-1, ...); --launch serves "
        "with --tenant-header set to it (default %(default)s)",
    )
    a(
        "--chaos-keys-file",
        default=None,
        metavar="FILE",
        help="name tenants by API key instead: the first key of each of the file's first "
        "--chaos-tenants tenants (kvray serve --api-keys-file's format; --launch serves "
        "with it)",
    )
    a(
        "--chaos-priorities",
        default=DEFAULT_PRIORITIES,
        metavar="PRIORITY:SHARE,...",
        help="request priorities and their shares (default %(default)s)",
    )
    a(
        "--chaos-output-len",
        type=int,
        nargs=2,
        default=(16, 128),
        metavar=("MIN", "MAX"),
        help="free-text requests' max_tokens, uniform in [MIN, MAX]; completions' prompts are "
        "8 to --input-len tokens (default 16 128)",
    )
    a(
        "--chaos-request-timeout-s",
        type=float,
        default=300.0,
        help="a request with no answer after this long counts as lost (default %(default)s)",
    )
    a(
        "--chaos-metrics-wait-s",
        type=float,
        default=12.0,
        help="after the run, wait this long for Ray's metrics agents to report the last "
        "migrations (default %(default)s; their report interval is 10 s)",
    )


@dataclass
class ChaosRun:
    results: list[ChaosResult]
    faults: list[Fault]
    t0: float
    stop: float
    end: float
    migrations: dict[str, int] | None


def check_args(args: argparse.Namespace) -> str:
    """Why the flags cannot run a chaos test ("" when they can)."""
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if backends != ["http"]:
        return "--chaos runs over the http backend"
    if args.fault_at is not None or args.overload:
        return "--chaos runs alone: not with --fault-at or --overload"
    if not args.launch and not args.app_name:
        return "--chaos needs --launch, or --app-name (this process connected to Ray)"
    if args.chaos <= 0:
        return "--chaos must be > 0 seconds"
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return "--max-concurrency must be >= 1"
    return ""


def chaos_mix(args: argparse.Namespace) -> ChaosMix:
    return ChaosMix(
        tenants=args.chaos_tenants,
        priorities=parse_priorities(args.chaos_priorities),
        output_len=tuple(args.chaos_output_len),
        input_len=(min(8, args.input_len), args.input_len),
    )


def chaos_plan(args: argparse.Namespace) -> tuple[PlannedFault, ...]:
    weights = parse_fault_weights(args.chaos_faults)
    return fault_schedule(
        args.seed, args.chaos, args.chaos_interval_s, args.chaos_min_gap_s, weights
    )


def tenant_identity(args: argparse.Namespace) -> TenantIdentity:
    if args.chaos_keys_file:
        from cluster.bench.chaos.client import keys_file_identity

        return keys_file_identity(args.chaos_keys_file, args.chaos_tenants)
    return TenantIdentity(header=args.chaos_tenant_header)


async def drive(
    client: Any,
    mix: ChaosMix,
    seed: int,
    token_ids: Sequence[int],
    workers: int,
    stop_at: float,
    t0: float,
) -> list[ChaosResult]:
    """`workers` loops, each sending request after request (indices 0, 1, ... in turn) until
    `stop_at` (perf_counter); every result, in index order."""
    results: list[ChaosResult] = []
    indices = itertools.count()

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            results.append(await client.send(request_at(mix, seed, next(indices), token_ids)))

    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            counts = {o: sum(1 for r in results if r.outcome == o) for o in (OK, ERROR, LOST)}
            print(
                f"t={time.perf_counter() - t0:.0f} s: {len(results)} answered ("
                + ", ".join(f"{k} {v}" for k, v in counts.items())
                + ")",
                flush=True,
            )

    ticker = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(worker() for _ in range(workers)))
    finally:
        ticker.cancel()
    return sorted(results, key=lambda r: r.request.index)


async def run_chaos(
    args: argparse.Namespace,
    ctx: BackendContext,
    app_name: str | None,
    mix: ChaosMix,
    plan: Sequence[PlannedFault],
    identity: TenantIdentity,
    token_ids: Sequence[int],
) -> ChaosRun:
    """Warm-up, then the timed run with its faults, the drain, the repairs and the migration
    counter (module doc)."""
    handle = stats_handle(app_name)
    if handle is None:
        raise RuntimeError("--chaos needs --launch, or --app-name with a Ray connection")
    urls = metrics_urls()
    client = ChaosClient.open(ctx, identity, args.chaos_request_timeout_s)
    try:
        # Each API, stream mode and schema once or more before the clock starts: grammars
        # compile and first calls pay their one-time costs outside the run.
        warm = max(8, args.warmup_requests)
        seed = args.seed + WARMUP_SEED_OFFSET
        await asyncio.gather(
            *(client.send(request_at(mix, seed, i, token_ids)) for i in range(warm))
        )
        before = await read_migrations(urls)
        t0 = time.perf_counter()
        stop_at = t0 + args.chaos
        injector = Injector(handle, args.num_replicas, args.seed, t0)
        watching = asyncio.create_task(injector.watch())
        faulting = asyncio.create_task(injector.run(plan, stop_at))
        try:
            workers = args.max_concurrency or DEFAULT_CONCURRENCY
            results = await drive(client, mix, args.seed, token_ids, workers, stop_at, t0)
            end = time.perf_counter()
            await faulting
        finally:
            faulting.cancel()
            watching.cancel()
        await injector.settle(time.perf_counter() + args.fault_recovery_timeout_s)
        await asyncio.sleep(max(0.0, end + args.chaos_metrics_wait_s - time.perf_counter()))
        after = await read_migrations(urls)
    finally:
        await client.close()
    return ChaosRun(results, injector.faults, t0, stop_at, end, migrations_between(before, after))


def run_command(args: argparse.Namespace, model_dir: Path, token_ids: Sequence[int]) -> int:
    """`kvray bench serve --chaos DURATION_S`."""
    problem = check_args(args)
    try:
        mix, plan, identity = chaos_mix(args), chaos_plan(args), tenant_identity(args)
    except (ValueError, OSError) as err:
        problem = problem or str(err)
    if problem:
        print(f"kvray bench serve: {problem}", file=sys.stderr)
        return 2
    workers = args.max_concurrency or DEFAULT_CONCURRENCY
    print(
        f"kvray bench serve --chaos {args.chaos:g}: {workers} requests in flight, "
        f"{len(plan)} faults planned (mean gap {args.chaos_interval_s:g} s, "
        f"{args.chaos_faults}), {mix.tenants} tenants, priorities {args.chaos_priorities}, "
        f"seed {args.seed}",
        flush=True,
    )
    overrides = (
        {"api_keys_file": str(Path(args.chaos_keys_file).resolve())}
        if args.chaos_keys_file
        else {"tenant_header": args.chaos_tenant_header}
    )
    with contextlib.ExitStack() as stack:
        ctx, app_name = single_app(
            args, server_context(args, model_dir), stack, workers + 8, overrides
        )
        # Its own event loop, closed before Serve and Ray shut down (as --fault-at's).
        run = asyncio.run(run_chaos(args, ctx, app_name, mix, plan, identity, token_ids))
    workload = {
        **describe_mix(mix),
        "seed": args.seed,
        "concurrency": workers,
        "duration_s": args.chaos,
        "fault_interval_s": args.chaos_interval_s,
        "fault_min_gap_s": args.chaos_min_gap_s,
        "fault_weights": args.chaos_faults,
        "schedule": [asdict(p) for p in plan],
    }

    def report(expected: dict[int, Any] | str, alone: dict[int, Any]) -> dict[str, Any]:
        summary = summarize_chaos(
            run.results,
            expected,
            run.faults,
            planned=len(plan),
            tenant_names=[identity.name(t) for t in range(mix.tenants)],
            t0=run.t0,
            stop=run.stop,
            end=run.end,
            migrations=run.migrations,
            alone=alone,
        )
        if args.result_json:
            write_result_json(args.result_json, {"workload": workload, "chaos": summary})
        return summary

    # The run's own figures first: a comparison that dies (minutes for a long run) loses
    # nothing else.
    report("the offline comparison did not finish", {})
    # With --launch, Ray is down now: the offline engine has the CPUs to itself.
    expected, alone = offline_answers(args, model_dir, run.results)
    summary = report(expected, alone)
    print()
    print(format_chaos(summary), flush=True)
    if args.result_json:
        print(f"\nwrote {args.result_json}")
    ok = chaos_ok(summary)
    if not ok:
        print("chaos: requests were lost or outputs changed", file=sys.stderr)
    return 0 if ok else 1


def offline_answers(
    args: argparse.Namespace, model_dir: Path, results: Sequence[ChaosResult]
) -> tuple[dict[int, Any] | str, dict[int, Any]]:
    """The offline engine's answers to the completed requests by index (or why there are
    none), and to each changed one run alone (does the engine's own answer depend on the
    batch?)."""
    from cluster.bench.chaos.expected import changes, expected_outputs

    finished = [r.request for r in results if r.outcome == OK]
    print(f"computing the offline engine's answers to {len(finished)} requests ...", flush=True)
    try:
        answers = expected_outputs(str(model_dir), finished, args.inprocess_threads)
        expected = {r.index: a for r, a in zip(finished, answers, strict=True)}
        changed = [
            r.request for r in results if r.outcome == OK and changes(r, expected[r.request.index])
        ]
        alone = {}
        if changed:
            each = expected_outputs(str(model_dir), changed, args.inprocess_threads, alone=True)
            alone = {r.index: a for r, a in zip(changed, each, strict=True)}
    except Exception as err:  # noqa: BLE001 - the run's own figures are still worth reporting
        return f"the offline engine failed: {type(err).__name__}: {err}", {}
    return expected, alone
