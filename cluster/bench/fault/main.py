"""`kvray bench serve --fault-at S`: kill the busiest replica mid-run, report what it cost.

    kvray bench serve --launch --num-replicas 2 --fault-at 10 --num-prompts 64 \\
        --max-concurrency 32                          # SIGKILL the busiest engine process at 10 s
    kvray bench serve --launch --num-replicas 2 --fault-at 10 --fault-kind replica
    kvray bench serve --base-url URL --app-name APP --num-replicas 2 --fault-at 5

At second S of the timed run the benchmark reads every LLMServer replica's stats, picks the
busiest (most requests running, then most waiting), and sends SIGKILL to its engine process
(`--fault-kind engine`, the replica's child) or to the replica actor's process (`replica`).
Streams are long (--fault-output-len, default 256-600 tokens each, instead of --output-len)
so that many span the kill. Reported (fault/report.py): requests completed / failed and the
failures' statuses, the streams in flight at the kill, the time from the kill to each active
stream's next token (p50 / p99 / max), output tokens/s before vs after the kill, and the time
until every replica serves again (the victim with a new engine child, restarted in place;
or Serve's replacement of a dead replica actor), watched for at most
--fault-recovery-timeout-s.

Needs a Ray connection in this process (--launch, or a test's session with --app-name) to
read the replicas' stats, and the replicas on this machine: the kill is os.kill, checked
against the target's command line first. The exit code is 0 only when every request
completed with exact usage (with request migration, a kill costs latency, not requests).
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

from cluster.bench.common.backend_types import BackendContext
from cluster.bench.common.launch import server_context, single_app
from cluster.bench.common.result import write_result_json
from cluster.bench.common.workload import BenchRequest, Workload, warmup_workload
from cluster.bench.fault.report import (
    DEFAULT_STALL_S,
    KillEvent,
    fault_ok,
    format_fault,
    summarize_fault,
)
from cluster.bench.fault.stream import FAULT_BACKENDS, StreamTrace, open_stream_client
from cluster.bench.serve.overload import stats_handle
from cluster.bench.serve.workload import build_workload

KINDS = ("engine", "replica")
STATS_CALL_TIMEOUT_S = 5.0
WHOLE_POLL_S = 0.5
# The command line each kind's target must have: a pid from stats that names some other
# process (a replica on another machine, a reused pid) is never signalled.
_TARGET_CMDLINE = {"engine": "workers.core.engine_child", "replica": "ray::ServeReplica"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "--fault-at S: kill the busiest replica mid-run (http or grpc backend)"
    )
    g.add_argument(
        "--fault-at",
        type=float,
        default=None,
        metavar="S",
        help="at second S of the timed run, SIGKILL the busiest replica's engine process (or "
        "actor, --fault-kind) and report completed / failed requests, the latency to the next "
        "token after the kill and throughput before vs after (needs --launch or --app-name)",
    )
    g.add_argument("--fault-kind", choices=KINDS, default="engine", help="what is killed")
    g.add_argument(
        "--fault-output-len",
        type=int,
        nargs=2,
        default=(256, 600),
        metavar=("MIN", "MAX"),
        help="--fault-at: output tokens per request, uniform in [MIN, MAX], in place of "
        "--output-len: streams long enough to span the kill (default 256 600)",
    )
    g.add_argument(
        "--fault-stall-s",
        type=float,
        default=DEFAULT_STALL_S,
        help="a stream whose next token comes later than this after the kill counts as "
        "interrupted (a migrated one), as does a failed one",
    )
    g.add_argument(
        "--fault-recovery-timeout-s",
        type=float,
        default=120.0,
        help="longest wait, from the kill, for every replica to serve again (0: do not watch)",
    )


def fault_workload(args: argparse.Namespace, token_ids: Sequence[int]) -> Workload:
    """The --workload's prompts, each with an output length drawn from --fault-output-len."""
    lo, hi = args.fault_output_len
    if not 1 <= lo <= hi:
        raise ValueError(f"--fault-output-len must be MIN MAX with 1 <= MIN <= MAX, got {lo} {hi}")
    base = build_workload(args, token_ids)
    rng = random.Random(args.seed + 1)
    requests = tuple(replace(r, output_len=rng.randint(lo, hi)) for r in base.requests)
    params = {k: v for k, v in base.params.items() if not k.startswith("output_len")}
    return Workload(base.name, requests, {**params, "output_len_range": [lo, hi]})


# -- replicas: find, kill, watch ----------------------------------------------------------------


async def all_replica_stats(
    handle: Any, replicas: int, exclude: str = ""
) -> dict[str, dict[str, Any]]:
    """Each LLMServer replica's stats by replica id: calls until `replicas` replicas other
    than `exclude` answered, at most `8 * replicas` calls.

    Each call has its own routing key, so the prefix-affinity router spreads them over the
    replicas; a call to a dying replica may fail, and is skipped."""
    seen: dict[str, dict[str, Any]] = {}
    for i in range(8 * replicas):
        try:
            call = handle.replica_stats.remote({"routing_key": f"fault-stats-{i}"})
            s = await asyncio.wait_for(asyncio.ensure_future(call), STATS_CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a replica going down mid-call is expected here
            continue
        seen[s["replica"]] = s
        if len(seen.keys() - {exclude}) >= replicas:
            break
    return seen


def busiest(stats: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The replica with the most requests running, then the most waiting or queued."""
    if not stats:
        return None
    return max(
        stats.values(),
        key=lambda s: (s["num_requests_running"], s["num_requests_waiting"] + s["queued"]),
    )


def target_pid(stats: dict[str, Any], kind: str) -> int | None:
    return stats.get("engine_pid") if kind == "engine" else stats.get("pid")


def kill_process(pid: int, kind: str) -> str:
    """SIGKILL `pid` after checking it is a process of `kind` on this machine; "" when done,
    else why not. Waits (briefly) until it is gone or a zombie."""
    import signal

    import psutil

    try:
        proc = psutil.Process(pid)
        cmdline = " ".join(proc.cmdline())
    except psutil.Error as err:
        return f"pid {pid} is not a process on this machine ({type(err).__name__})"
    if _TARGET_CMDLINE[kind] not in cmdline:
        return f"pid {pid} is not a {kind} process here: {cmdline[:80]!r}"
    try:
        proc.send_signal(signal.SIGKILL)
    except psutil.Error as err:
        return f"pid {pid} could not be signalled ({type(err).__name__})"
    return ""


def pid_gone(pid: int | None) -> bool:
    """No such process, or only its zombie (dead, not yet reaped by its parent)."""
    import psutil

    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


async def kill_busiest(handle: Any, kind: str, replicas: int) -> KillEvent:
    stats = await all_replica_stats(handle, replicas)
    victim = busiest(stats)
    if victim is None:
        return KillEvent(kind, time.perf_counter(), error="no replica answered its stats")
    pid = target_pid(victim, kind)
    event = KillEvent(
        kind,
        0.0,
        replica=victim["replica"],
        pid=pid,
        running=victim["num_requests_running"],
        waiting=victim["num_requests_waiting"] + victim["queued"],
        replicas_seen=len(stats),
    )
    if pid is None:
        why = "its engine runs on a thread (--fault-kind replica kills the whole replica)"
        return replace(event, at=time.perf_counter(), error=f"no {kind} pid: {why}")
    error = kill_process(pid, kind)
    return replace(event, at=time.perf_counter(), error=error)


async def wait_whole(
    handle: Any, replicas: int, victim: str, deadline: float, dead_engine: int | None = None
) -> float | None:
    """perf_counter time `replicas` replicas were first seen serving: others than `victim`
    (Serve replaced a dead one), or the victim itself with another engine than `dead_engine`
    (restarted in place); None past `deadline`."""
    while time.perf_counter() < deadline:
        stats = await all_replica_stats(handle, replicas)
        serving = [
            r
            for r, s in stats.items()
            if r != victim or (dead_engine is not None and s.get("engine_pid") != dead_engine)
        ]
        if len(serving) >= replicas:
            return time.perf_counter()
        await asyncio.sleep(WHOLE_POLL_S)
    return None


# -- the run ----------------------------------------------------------------------------------


async def send_all(
    client: Any, requests: Sequence[BenchRequest], rate: float, limit: int | None, seed: int
) -> list[StreamTrace]:
    """Every request (Poisson arrivals at `rate`, at most `limit` in flight)."""
    sem = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
    rng = random.Random(seed)

    async def one(req: BenchRequest) -> StreamTrace:
        async with sem:
            return await client.send(req)

    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def run_fault(
    args: argparse.Namespace,
    backend: str,
    ctx: BackendContext,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    app_name: str | None,
) -> dict[str, Any]:
    """Warm-up, then the timed run with the kill at --fault-at; the summary (fault_report)."""
    handle = stats_handle(app_name)
    if handle is None:
        raise RuntimeError("--fault-at needs --launch, or --app-name with a Ray connection")
    client = await open_stream_client(backend, ctx)
    try:
        await asyncio.gather(*(client.send(r) for r in warmup))
        t0 = time.perf_counter()
        sending = asyncio.create_task(
            send_all(client, requests, args.request_rate, args.max_concurrency, args.seed)
        )
        fired = asyncio.Event()
        fault = asyncio.create_task(_fault(handle, args, t0, fired))
        try:
            traces = await sending
        except BaseException:
            fault.cancel()
            raise
        end = time.perf_counter()
        kill, whole_at = None, None
        if not fired.is_set():
            fault.cancel()  # the run ended before the fault
        with contextlib.suppress(asyncio.CancelledError):
            kill, whole_at = await fault
    finally:
        await client.close()
    summary = summarize_fault(
        traces, kill, t0=t0, end=end, whole_at=whole_at, stall_s=args.fault_stall_s
    )
    summary["backend"] = backend
    return summary


async def _gone_soon(pid: int | None, timeout_s: float = 5.0) -> bool:
    """Whether `pid` is gone (or a zombie) within `timeout_s`: SIGKILL is not instant."""
    deadline = time.perf_counter() + timeout_s
    while not pid_gone(pid):
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _fault(
    handle: Any, args: argparse.Namespace, t0: float, fired: asyncio.Event
) -> tuple[KillEvent, float | None]:
    """Sleeps until --fault-at, kills, sets `fired`; then watches for the service whole."""
    await asyncio.sleep(max(0.0, t0 + args.fault_at - time.perf_counter()))
    kill = await kill_busiest(handle, args.fault_kind, args.num_replicas)
    fired.set()  # no await since the signal: a cancel after this point cannot undo a kill
    if kill.killed:
        kill = replace(kill, pid_gone=await _gone_soon(kill.pid))
    print(
        f"t={kill.at - t0:.2f} s: "
        + (
            f"killed the {kill.kind} process of replica {kill.replica} (pid {kill.pid}; "
            f"{kill.running} running, {kill.waiting} waiting)"
            if kill.killed
            else f"no kill: {kill.error}"
        ),
        flush=True,
    )
    whole_at = None
    if kill.killed and args.fault_recovery_timeout_s > 0:
        whole_at = await wait_whole(
            handle,
            args.num_replicas,
            kill.replica,
            kill.at + args.fault_recovery_timeout_s,
            dead_engine=kill.pid if kill.kind == "engine" else None,
        )
    return kill, whole_at


# -- the command ------------------------------------------------------------------------------


def run_command(args: argparse.Namespace, model_dir: Path, token_ids: Sequence[int]) -> int:
    """`kvray bench serve --fault-at S`."""
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    problem = ""
    if len(backends) != 1 or backends[0] not in FAULT_BACKENDS:
        problem = f"--fault-at runs over one backend, {' or '.join(FAULT_BACKENDS)}"
    elif args.workload == "json-schema":
        problem = "--fault-at runs the random, shared-prefix or tenants-zipf workload"
    elif not args.launch and not args.app_name:
        problem = "--fault-at needs --launch, or --app-name (this process connected to Ray)"
    elif args.fault_at < 0:
        problem = "--fault-at must be >= 0"
    if problem:
        print(f"kvray bench serve: {problem}", file=sys.stderr)
        return 2
    workload = fault_workload(args, token_ids)
    warmup = warmup_workload(token_ids, seed=args.seed, num=args.warmup_requests)
    lo, hi = args.fault_output_len
    print(
        f"kvray bench serve --fault-at {args.fault_at:g} ({args.fault_kind}): workload "
        f"{workload.name}, {len(workload.requests)} requests of {args.input_len} prompt + "
        f"{lo}-{hi} output tokens, rate {args.request_rate}, max concurrency "
        f"{args.max_concurrency}, over {backends[0]}"
    )
    base = server_context(args, model_dir)
    with contextlib.ExitStack() as stack:
        queued = len(workload.requests) + len(warmup.requests)
        ctx, app_name = single_app(args, base, stack, max_queued=queued)
        # Its own event loop, closed before Serve and Ray shut down (as --overload's).
        summary = asyncio.run(
            run_fault(args, backends[0], ctx, workload.requests, warmup.requests, app_name)
        )
    print()
    print(format_fault(summary), flush=True)
    if args.result_json:
        write_result_json(args.result_json, {"workload": workload.describe(), "fault": summary})
        print(f"\nwrote {args.result_json}")
    return 0 if fault_ok(summary) else 1
