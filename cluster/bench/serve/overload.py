"""`kvray bench serve --overload N`: N requests at once, far past the server's caps.

    kvray bench serve --launch --overload 2000            # default caps, two replicas
    kvray bench serve --base-url http://127.0.0.1:8000 --overload 2000

What a production server must do under a burst it cannot take: answer every request (200, or
a fast 429 / 503 with Retry-After), keep its liveness probe fast, and be idle again soon after.
Reported: status counts (200 / 429 / 503 / other / client timeout), the share completed,
latency of answers and of refusals, `/health` latency (p50 / p99 / max) measured from ANOTHER
process while the burst runs (a probe on the load generator's event loop would measure the
client's own backlog), and the time to drain: from the last request sent until every request
is answered and the replicas report nothing running or waiting.

Replica stats need a Ray connection in this process (--launch, or a test's own Ray session
with --app-name); without one the drain ends at the last answer, and the report says so.
Requests are non-streamed completions with token-id prompts and ignore_eos (the same work as
the latency bench); the exit code is 1 when any request timed out or failed with a status
other than 200 / 429 / 503.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from cluster.bench.common.workload import BenchRequest

OUTCOMES = ("200", "429", "503", "other", "timeout")
# Seconds one /health probe may take before it counts as failed.
HEALTH_PROBE_TIMEOUT_S = 10.0
PROBE_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    """One request's end: its HTTP status (None: no answer within the client timeout, or the
    connection failed), seconds from sending to the answer, and what went wrong."""

    status: int | None
    latency_s: float
    timed_out: bool = False
    error: str = ""

    @property
    def kind(self) -> str:
        if self.timed_out:
            return "timeout"
        if self.status in (200, 429, 503):
            return str(self.status)
        return "other"


@dataclass(frozen=True)
class HealthProbe:
    latency_s: float
    ok: bool  # 200 within HEALTH_PROBE_TIMEOUT_S


# -- the report (pure) --------------------------------------------------------------------------


def percentile_ms(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of seconds, in ms; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize_overload(
    outcomes: Sequence[Outcome],
    health: Sequence[HealthProbe],
    *,
    last_sent: float,
    last_answer: float,
    idle_at: float | None,
) -> dict[str, Any]:
    """The report of one overload run. Times are one clock's seconds; `idle_at` is when the
    replicas were seen idle after the last answer (None: no replica stats)."""
    counts = Counter(o.kind for o in outcomes)
    by_kind = {k: [o.latency_s for o in outcomes if o.kind == k] for k in OUTCOMES}
    refused = by_kind["429"] + by_kind["503"]
    errors = Counter(o.error for o in outcomes if o.kind in ("other", "timeout") and o.error)
    health_ok = [p.latency_s for p in health if p.ok]
    return {
        "requests": len(outcomes),
        "counts": {k: counts.get(k, 0) for k in OUTCOMES},
        "completed_share": counts.get("200", 0) / len(outcomes) if outcomes else 0.0,
        "answer_ms": {
            "median": percentile_ms(by_kind["200"], 0.5),
            "p99": percentile_ms(by_kind["200"], 0.99),
        },
        "refusal_ms": {"median": percentile_ms(refused, 0.5), "p99": percentile_ms(refused, 0.99)},
        "health": {
            "probes": len(health),
            "failed": len(health) - len(health_ok),
            # A failed probe counts at its full time: a p99 must not hide the worst ones.
            "p50_ms": percentile_ms([p.latency_s for p in health], 0.5),
            "p99_ms": percentile_ms([p.latency_s for p in health], 0.99),
            "max_ms": percentile_ms([p.latency_s for p in health], 1.0),
        },
        "last_answer_after_last_sent_s": max(0.0, last_answer - last_sent),
        "drain_s": None if idle_at is None else max(0.0, idle_at - last_sent),
        "errors": [f"{n} x {e}" for e, n in errors.most_common(5)],
    }


def overload_ok(summary: dict[str, Any]) -> bool:
    """No request hung (client timeout) and none failed other than 200 / 429 / 503."""
    return summary["counts"]["timeout"] == 0 and summary["counts"]["other"] == 0


def format_overload(summary: dict[str, Any]) -> str:
    c, h = summary["counts"], summary["health"]
    drain = summary["drain_s"]
    rows = [
        f"overload: {summary['requests']} requests at once",
        "  status:   " + ", ".join(f"{k} {c[k]}" for k in OUTCOMES),
        f"  completed {summary['completed_share']:.1%}; answers median/p99 "
        f"{summary['answer_ms']['median']:.0f}/{summary['answer_ms']['p99']:.0f} ms, refusals "
        f"median/p99 {summary['refusal_ms']['median']:.0f}/{summary['refusal_ms']['p99']:.0f} ms",
        f"  {h.get('path', '/health')} from another process: {h['probes']} probes, "
        f"{h['failed']} failed, "
        f"p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, max {h['max_ms']:.1f} ms",
        f"  drain: last answer {summary['last_answer_after_last_sent_s']:.2f} s after the last "
        "request was sent; "
        + (
            f"replicas idle after {drain:.2f} s"
            if drain is not None
            else "replica stats unknown (needs --launch or --app-name with a Ray connection)"
        ),
    ]
    if summary["errors"]:
        rows.append("  errors: " + "; ".join(summary["errors"]))
    return "\n".join(rows)


# -- the /health probe, in its own process --------------------------------------------------------


def probe_health(url: str, interval_s: float, started: Any, stop: Any, out: Connection) -> None:
    """Another process's loop: GET `url` one at a time, `interval_s` apart, until `stop` is
    set; then sends the list of HealthProbe down `out`. Sets `started` when it begins."""
    probes: list[HealthProbe] = []
    started.set()
    while not stop.is_set():
        start = time.perf_counter()
        ok = False
        try:
            with urllib.request.urlopen(url, timeout=HEALTH_PROBE_TIMEOUT_S) as resp:
                resp.read()
                ok = resp.status == 200
        except Exception:  # noqa: BLE001 - a failed probe is a data point
            ok = False
        probes.append(HealthProbe(time.perf_counter() - start, ok))
        stop.wait(interval_s)
    out.send(probes)
    out.close()


class HealthProber:
    """Runs probe_health in a spawned process (its own interpreter, its own event loop)."""

    def __init__(self, url: str, interval_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, started = ctx.Event(), ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=probe_health, args=(url, interval_s, started, self._stop, send), daemon=True
        )
        self._proc.start()
        send.close()
        # Probing before the burst starts: a new interpreter takes a while to come up.
        if not started.wait(PROBE_START_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(
                f"the /health probe process did not start in {PROBE_START_TIMEOUT_S} s"
            )

    def stop(self) -> list[HealthProbe]:
        self._stop.set()
        try:
            if not self._recv.poll(HEALTH_PROBE_TIMEOUT_S + 5):
                return []
            return self._recv.recv()
        finally:
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()


# -- the burst ------------------------------------------------------------------------------------


async def send_burst(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    api_key: str | None,
    timeout_s: float,
    progress: bool = True,
) -> tuple[list[Outcome], float, float]:
    """Every request at once (non-streamed completions); (outcomes, last sent, last answer)
    with times on time.perf_counter's clock. "Sent" is when a request's headers went out."""
    import aiohttp
    from tqdm import tqdm

    url = f"{base_url.rstrip('/')}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sent: list[float] = []

    async def on_headers_sent(*_: Any) -> None:
        sent.append(time.perf_counter())

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(on_headers_sent)
    bar = tqdm(total=len(requests), desc="overload", unit="req", disable=not progress)
    counts: Counter[str] = Counter()

    async def one(session: aiohttp.ClientSession, req: BenchRequest) -> Outcome:
        body = {
            "model": model,
            "prompt": list(req.prompt_ids),
            "max_tokens": req.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        start = time.perf_counter()
        try:
            async with session.post(url, json=body, headers=headers) as resp:
                text = await resp.text()
                error = "" if resp.status == 200 else f"HTTP {resp.status}: {text[:120]}"
                out = Outcome(resp.status, time.perf_counter() - start, error=error)
        except TimeoutError:
            out = Outcome(None, time.perf_counter() - start, timed_out=True, error="timeout")
        except aiohttp.ClientError as err:
            out = Outcome(None, time.perf_counter() - start, error=f"{type(err).__name__}: {err}")
        counts[out.kind] += 1
        bar.update()
        bar.set_postfix({k: counts[k] for k in OUTCOMES if counts[k]}, refresh=False)
        return out

    _raise_fd_limit(len(requests) + 256)
    connector = aiohttp.TCPConnector(limit=0)  # every request at once: no client-side queue
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, trace_configs=[trace]
        ) as session:
            outcomes = await asyncio.gather(*(one(session, r) for r in requests))
    finally:
        bar.close()
    last_answer = time.perf_counter()
    return list(outcomes), max(sent, default=last_answer), last_answer


def _raise_fd_limit(need: int) -> None:
    """One socket per request: lift this process's soft open-file limit (often 1024) toward
    its hard limit, so that a burst of thousands is not cut short by EMFILE."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard)
    )


# -- replica stats --------------------------------------------------------------------------------


async def replicas_idle(handle: Any, replicas: int) -> bool:
    """Whether `replicas` LLMServer replicas all report nothing running, waiting or queued.

    Each call carries its own routing key, so the prefix-affinity router spreads them over
    the replicas (tests/cluster/serve_helpers.replica_stats does the same)."""
    seen: dict[str, dict[str, Any]] = {}
    for i in range(8 * replicas):
        s = await handle.replica_stats.remote({"routing_key": f"overload-stats-{i}"})
        seen[s["replica"]] = s
        if len(seen) >= replicas:
            break
    return len(seen) >= replicas and all(
        s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0 and s["queued"] == 0
        for s in seen.values()
    )


async def wait_idle(handle: Any, replicas: int, timeout_s: float) -> float | None:
    """perf_counter time the replicas were first seen idle; None past `timeout_s`."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if await replicas_idle(handle, replicas):
            return time.perf_counter()
        await asyncio.sleep(0.05)
    return None


def stats_handle(app_name: str | None) -> Any:
    """The LLMServer handle of `app_name` when this process has a Ray connection, else None."""
    if not app_name:
        return None
    import ray

    if not ray.is_initialized():
        return None
    from ray import serve

    from cluster.deploy.app import LLM_SERVER_NAME

    handle = serve.get_deployment_handle(LLM_SERVER_NAME, app_name=app_name)
    if not handle.is_initialized:  # Serve hands out one cached handle per deployment
        # Routed on Serve's own thread, not this event loop: the handle then works from any
        # loop, and Serve's shutdown stops it at once (one bound to asyncio.run's loop would
        # be shut down after that loop closed, and fail).
        handle._init(_run_router_in_separate_loop=True)
    return handle


# -- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--overload N: a burst far past the caps (http backend)")
    g.add_argument(
        "--overload",
        type=int,
        default=0,
        metavar="N",
        help="send N requests at once and report status counts, /health latency from another "
        "process and the time to drain (--launch keeps the app's default caps)",
    )
    g.add_argument("--overload-timeout-s", type=float, default=600.0, help="client timeout")
    g.add_argument("--health-interval-ms", type=float, default=50.0, help="between /health probes")
    g.add_argument(
        "--health-path",
        default="/health",
        help="path the probe GETs: kvray's /health (the ingress replica answers it), or "
        "/-/healthz (Serve's proxy answers it)",
    )
    g.add_argument("--drain-timeout-s", type=float, default=300.0, help="longest wait for idle")
    g.add_argument(
        "--app-name",
        default=None,
        help="Serve app whose replica stats tell when it is idle (this process must be "
        "connected to its Ray cluster; --launch sets it)",
    )


async def run_overload(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    app_name: str | None,
) -> dict[str, Any]:
    """Warm-up, then the burst with the /health probe running, then the wait for idle (when
    `app_name`'s replica stats can be read)."""
    handle = stats_handle(app_name)
    if warmup:
        await send_burst(
            base_url, model, warmup, api_key=args.api_key, timeout_s=120, progress=False
        )
    prober = HealthProber(base_url.rstrip("/") + args.health_path, args.health_interval_ms / 1000)
    try:
        outcomes, last_sent, last_answer = await send_burst(
            base_url, model, requests, api_key=args.api_key, timeout_s=args.overload_timeout_s
        )
        idle_at = None
        if handle is not None:
            idle_at = await wait_idle(handle, args.num_replicas, args.drain_timeout_s)
    finally:
        health = await asyncio.to_thread(prober.stop)
    summary = summarize_overload(
        outcomes, health, last_sent=last_sent, last_answer=last_answer, idle_at=idle_at
    )
    summary["health"]["path"] = args.health_path
    if handle is not None and idle_at is None:
        summary["errors"].append(f"replicas not idle within {args.drain_timeout_s:g} s")
    return summary


def print_overload(summary: dict[str, Any]) -> None:
    print()
    print(format_overload(summary), flush=True)
    if not overload_ok(summary):
        print("overload: some requests timed out or failed unexpectedly", file=sys.stderr)
