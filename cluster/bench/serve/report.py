"""Statistics and the printed report of `kvray bench serve`: per-run latency summaries
(TTFT, TPOT, ITL, E2E), backend-vs-inprocess comparisons, and the table."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from cluster.bench.common.backend_types import RequestRecord


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
