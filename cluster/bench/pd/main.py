"""`kvray bench pd`: prefill/decode disaggregation against colocated replicas, one trace.

    kvray bench pd --model random:qwen3-100m --burst-prompt-len 1024

Each set-up gets the same number of engine replicas (--replicas) on one local Ray:
`colocated` (all of them LLMServer, every replica prefilling and decoding), `always` (one
prefill replica, the rest decode, every request disaggregated) and `auto` (the same, the
policy deciding). Each replays the trace of cluster/bench/pd/trace.py twice: a quiet phase
(steady streams of short prompts) and a bursty one (the same plus bursts of long prompts).

Reported per set-up: the steady streams' gap between chunks p50 / p99 (stream_interval_ms 0:
a chunk per token) in both phases and its bursty / quiet ratio, their TTFT, the long
prompts' TTFT, and goodput: requests per second that met both SLOs (TTFT <= --ttft-slo-ms,
mean time per output token <= --tpot-slo-ms). Every set-up runs the engines' chunked prefill
at --max-num-batched-tokens (auto's bound too). Greedy outputs of the keys every set-up
served must be identical across set-ups: a difference is printed and the command exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict, replace
from typing import Any

from cluster.bench.common.model_arg import add_model_argument, bench_model_dir
from cluster.bench.common.result import write_result_json
from cluster.bench.pd.trace import Record, TraceShape, replay

SETUPS = ("colocated", "always", "auto")
APP = "kvray-bench-pd"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    add_model_argument(parser)
    a("--setups", default=",".join(SETUPS), help="comma list of colocated, always, auto")
    a("--replicas", type=int, default=2, help="engine replicas of every set-up (default 2)")
    a("--streams", type=int, default=3, help="steady streams (default 3)")
    a("--steady-prompt-len", type=int, default=64)
    a("--steady-output-len", type=int, default=48)
    a("--burst-prompt-len", type=int, default=1024)
    a("--burst-output-len", type=int, default=8)
    a("--burst-size", type=int, default=2, help="long prompts per burst (default 2)")
    a("--burst-every-s", type=float, default=4.0)
    a("--phase-s", type=float, default=20.0, help="seconds of each phase (default 20)")
    a("--max-num-batched-tokens", type=int, default=512, help="chunked prefill's step budget")
    a("--ttft-slo-ms", type=float, default=3000.0)
    a("--tpot-slo-ms", type=float, default=150.0)
    a("--seed", type=int, default=0)
    a("--result-json", default=None, metavar="FILE", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bad = [s for s in setups if s not in SETUPS]
    if bad or not setups:
        raise SystemExit(f"--setups: unknown {', '.join(bad) or '(none)'}; use {SETUPS}")
    if args.replicas < 2:
        raise SystemExit("--replicas must be at least 2 (one prefill, one decode)")
    model_dir = bench_model_dir(args.model)
    shape = TraceShape(
        args.streams,
        args.steady_prompt_len,
        args.steady_output_len,
        args.burst_prompt_len,
        args.burst_output_len,
        args.burst_size,
        args.burst_every_s,
        args.phase_s,
        args.seed,
    )
    from cluster.bench.common.backend_types import BackendContext
    from cluster.bench.common.launch import _free_port
    from cluster.bench.common.workload import sampleable_token_ids
    from cluster.cli.local_ray import init_local_ray
    from cluster.deploy.serve_env import apply_serve_env

    apply_serve_env()  # as `kvray serve` runs it; before anything imports ray.serve
    import ray
    from ray import serve

    from cluster.deploy.app import build_app

    ids = sampleable_token_ids(model_dir)
    port = _free_port()
    init_local_ray(
        address="local",
        num_cpus=max(4, args.replicas + 2),
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[str, str]] = {}
    try:
        for setup in setups:
            config = _config(setup, args, str(model_dir))
            print(f"{setup}: deploying {args.replicas} engine replicas ...", flush=True)
            serve.run(build_app(config), name=APP, route_prefix="/")
            ctx = BackendContext(
                config.engine.model_name(), str(model_dir), f"http://127.0.0.1:{port}"
            )
            warm = replace(shape, phase_s=min(4.0, shape.phase_s), burst_every_s=1.0)
            asyncio.run(replay(ctx, warm, ids, "warm", bursts=True))  # untimed
            before = _prefilled(config)
            quiet = asyncio.run(replay(ctx, shape, ids, "quiet", bursts=False))
            bursty = asyncio.run(replay(ctx, shape, ids, "bursty", bursts=True))
            prefilled = _prefilled(config) - before
            serve.delete(APP)
            results[setup] = summarize(quiet, bursty, shape, args)
            results[setup]["prefilled"] = prefilled
            outputs[setup] = {r.key: r.text for r in quiet + bursty if not r.error}
            print(f"{setup}: done", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print()
    print(_table(results, setups, args))
    sent = [
        f"{s} {results[s]['prefilled']} of {results[s]['requests_both_phases']}"
        for s in setups
        if s != "colocated"
    ]
    if sent:
        print("requests prefilled on a prefill replica: " + ", ".join(sent))
    mismatches = _mismatches(outputs)
    if mismatches:
        print(f"\nOUTPUT MISMATCH across set-ups: {len(mismatches)} requests, e.g.")
        for m in mismatches[:5]:
            print(f"  {m}")
    else:
        common = min(len(o) for o in outputs.values())
        print(f"\ngreedy outputs: identical across set-ups ({common} requests compared)")
    if args.result_json:
        write_result_json(
            args.result_json,
            {"model": str(model_dir), "trace": asdict(shape), "setups": results,
             "mismatches": mismatches},
        )  # fmt: skip
    failed = sum(r["errors"] for r in results.values())
    return 1 if mismatches or failed else 0


def _config(setup: str, args: argparse.Namespace, model: str) -> Any:
    from cluster.config import ServeConfig

    common = {
        "model": model,
        "request_router": "kv_events",
        "stream_interval_ms": 0,  # a chunk per token: the gaps are inter-token latencies
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_offload_gib": 0.25,
        "kv_share_gib": 0.5,
    }
    if setup == "colocated":
        return ServeConfig.from_flat(num_replicas=args.replicas, **common)
    return ServeConfig.from_flat(
        num_replicas=args.replicas - 1, prefill_replicas=1, pd=setup, **common
    )


def _prefilled(config: Any) -> int:
    """Requests the prefill replicas have run so far (each generates the hand-off's tokens;
    one that stopped earlier counts less): how many `auto` sent there."""
    if not config.pd.enabled:
        return 0
    from ray import serve

    from cluster.deploy.app import PREFILL_SERVER_NAME
    from cluster.ingress.pd import HANDOFF_TOKENS

    handle = serve.get_deployment_handle(PREFILL_SERVER_NAME, APP)
    # `kvray serve`'s Serve settings route handles on the caller's event loop, which this
    # code has none of: this one routes on Serve's own thread.
    if not handle.is_initialized:
        handle._init(_run_router_in_separate_loop=True)
    seen: dict[str, int] = {}
    for i in range(4 * config.pd.prefill_replicas):  # a key each reaches every replica
        s = handle.replica_stats.remote({"routing_key": f"bench-{i}"}).result()
        seen[s["replica"]] = s["generation_tokens"]
    return sum(seen.values()) // HANDOFF_TOKENS


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN of nothing."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summarize(
    quiet: list[Record], bursty: list[Record], shape: TraceShape, args: argparse.Namespace
) -> dict[str, Any]:
    def steady(rs: list[Record]) -> list[Record]:
        return [r for r in rs if r.kind == "steady" and not r.error]

    q_gaps = [g for r in steady(quiet) for g in r.gaps]
    b_gaps = [g for r in steady(bursty) for g in r.gaps]
    longs = [r for r in bursty if r.kind == "burst" and not r.error]
    ok = [r for r in bursty if not r.error]
    good = [r for r in ok if r.ttft * 1e3 <= args.ttft_slo_ms and r.tpot * 1e3 <= args.tpot_slo_ms]
    return {
        "quiet_gap_ms": {"p50": _pct(q_gaps, 0.5) * 1e3, "p99": _pct(q_gaps, 0.99) * 1e3},
        "bursty_gap_ms": {"p50": _pct(b_gaps, 0.5) * 1e3, "p99": _pct(b_gaps, 0.99) * 1e3},
        "gap_p99_bursty_over_quiet": _pct(b_gaps, 0.99) / _pct(q_gaps, 0.99),
        "steady_ttft_ms": {
            "p50": _pct([r.ttft for r in steady(bursty)], 0.5) * 1e3,
            "p99": _pct([r.ttft for r in steady(bursty)], 0.99) * 1e3,
        },
        "burst_ttft_ms": {
            "p50": _pct([r.ttft for r in longs], 0.5) * 1e3,
            "p99": _pct([r.ttft for r in longs], 0.99) * 1e3,
        },
        "requests": len(ok),
        "requests_both_phases": sum(1 for r in quiet + bursty if not r.error),
        "good": len(good),
        "goodput_per_s": len(good) / shape.phase_s,
        "throughput_per_s": len(ok) / shape.phase_s,
        "errors": sum(1 for r in quiet + bursty if r.error),
    }


def _table(results: dict[str, dict[str, Any]], setups: list[str], args: argparse.Namespace) -> str:
    head = (
        f"{'set-up':>10} {'quiet gap p50/p99 ms':>22} {'bursty gap p50/p99 ms':>22} "
        f"{'p99 b/q':>8} {'steady TTFT p50/p99':>21} {'long TTFT p50/p99':>19} "
        f"{'req/s':>6} {'goodput/s':>9} {'errors':>6}"
    )
    lines = [
        f"SLO: TTFT <= {args.ttft_slo_ms:g} ms and mean time per output token <= "
        f"{args.tpot_slo_ms:g} ms; bursty phase",
        head,
    ]
    for s in setups:
        r = results[s]
        q, b = r["quiet_gap_ms"], r["bursty_gap_ms"]
        st, lt = r["steady_ttft_ms"], r["burst_ttft_ms"]
        lines.append(
            f"{s:>10} {q['p50']:>10.1f} / {q['p99']:<9.1f} {b['p50']:>10.1f} / {b['p99']:<9.1f} "
            f"{r['gap_p99_bursty_over_quiet']:>7.2f}x {st['p50']:>9.0f} / {st['p99']:<9.0f} "
            f"{lt['p50']:>8.0f} / {lt['p99']:<8.0f} {r['throughput_per_s']:>6.2f} "
            f"{r['goodput_per_s']:>9.2f} {r['errors']:>6}"
        )
    return "\n".join(lines)


def _mismatches(outputs: dict[str, dict[str, str]]) -> list[str]:
    """Keys every set-up served whose outputs differ."""
    names = list(outputs)
    common = set.intersection(*(set(o) for o in outputs.values())) if outputs else set()
    out = []
    for key in sorted(common):
        texts = {n: outputs[n][key] for n in names}
        if len(set(texts.values())) > 1:
            out.append(f"{key}: " + ", ".join(f"{n} {t[:30]!r}" for n, t in texts.items()))
    return out
