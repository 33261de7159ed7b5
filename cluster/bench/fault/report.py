"""The statistics and the printed report of `kvray bench serve --fault-at` (pure functions).

Inputs: every stream's trace (fault_stream.StreamTrace), the kill (KillEvent), and the time
the service was seen whole again. Times are time.perf_counter seconds; the report gives them
relative to the start of the timed run (t0) or to the kill.

- requests completed / failed, the statuses of the failures, and the top error messages;
- the streams in flight at the kill: the killed replica's own count (its stats just before
  the kill: running + waiting) and, client-side, the streams sent before the kill that had
  not ended; of these, the ones interrupted: failed, or their next token came more than
  `stall_s` after the kill (with migration a stream moved to another replica shows as a
  long gap, not a failure);
- the time from the kill to each active stream's next token (p50, p99, max), next to the
  median gap between tokens before the kill, so the added latency reads against it;
- output tokens/s before the kill [t0, kill) and after it [kill, end), and per second;
- usage checks: completed streams whose usage differs from the tokens they received (a lost
  or repeated token);
- how long until every replica was serving again (None: not observed).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cluster.bench.fault.stream import StreamTrace
from cluster.bench.serve.overload import percentile_ms

DEFAULT_STALL_S = 1.0
_WHAT = {"engine": "engine process", "replica": "actor process"}
# Gaps that begin this long after the kill still count as its doing: a stream on the killed
# replica first receives the tokens already on their way (the server batches them for up
# to --stream-interval-ms), then waits for its migration.
GAP_WINDOW_S = 5.0


@dataclass(frozen=True)
class KillEvent:
    """What the fault did. `at` is when the signal was sent (perf_counter); `error` is set,
    and nothing was killed, when no target could be found or signalled."""

    kind: str  # "engine" or "replica"
    at: float
    replica: str = ""
    pid: int | None = None
    running: int = 0  # the victim's num_requests_running just before the kill
    waiting: int = 0  # ... num_requests_waiting + its queue
    replicas_seen: int = 0
    pid_gone: bool = False  # seen dead (or a zombie) within seconds of the signal
    error: str = ""

    @property
    def killed(self) -> bool:
        return not self.error and self.pid is not None


def active_at(trace: StreamTrace, t: float) -> bool:
    """Sent before `t` and not ended by then (a stream ending exactly at `t` is not)."""
    return trace.sent < t < trace.end


def next_token_after(trace: StreamTrace, t: float) -> float | None:
    """Seconds from `t` to the stream's first chunk after it; None when none came."""
    later = [at for at, _ in trace.chunks if at >= t]
    return min(later) - t if later else None


def longest_gap_after(trace: StreamTrace, t: float, window_s: float = GAP_WINDOW_S) -> float:
    """The longest wait of the stream after `t`: from `t` to its first chunk, or between two
    of its chunks, counting waits that begin before `t + window_s`; to its end when it got
    no chunk after `t` (it failed, or had only its usage left to send)."""
    times = [t] + [at for at, _ in trace.chunks if at >= t]
    if len(times) == 1:
        return max(0.0, trace.end - t)
    return max(b - a for a, b in zip(times, times[1:], strict=False) if a < t + window_s)


def tokens_between(traces: Sequence[StreamTrace], lo: float, hi: float) -> int:
    return sum(n for tr in traces for at, n in tr.chunks if lo <= at < hi)


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def median_gap_s(traces: Sequence[StreamTrace], before: float) -> float:
    """The median gap between consecutive chunks of one stream, chunks before `before`."""
    gaps = []
    for tr in traces:
        times = [at for at, _ in tr.chunks if at < before]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else 0.0


def per_second(traces: Sequence[StreamTrace], t0: float, end: float) -> list[int]:
    """Output tokens received in each whole second from t0 (the last one partial)."""
    buckets = [0] * max(1, math.ceil(end - t0))
    for tr in traces:
        for at, n in tr.chunks:
            if t0 <= at < end:
                buckets[min(len(buckets) - 1, int(at - t0))] += n
    return buckets


def summarize_fault(
    traces: Sequence[StreamTrace],
    kill: KillEvent | None,
    *,
    t0: float,
    end: float,
    whole_at: float | None,
    stall_s: float = DEFAULT_STALL_S,
) -> dict[str, Any]:
    """The report of one fault run; `whole_at` is when every replica was seen serving again
    after the kill (None: not observed or not waited for)."""
    ok = [t for t in traces if t.ok]
    failed = [t for t in traces if not t.ok]
    errors = Counter(f"{t.status}: {t.error}" for t in failed)
    s: dict[str, Any] = {
        "requests": len(traces),
        "completed": len(ok),
        "failed": len(failed),
        "failed_by_status": dict(Counter(t.status for t in failed).most_common()),
        "errors": [f"{n} x {e}" for e, n in errors.most_common(5)],
        "duration_s": end - t0,
        "output_tokens_received": sum(t.tokens for t in traces),
        "usage_mismatches": sum(1 for t in ok if t.output_len != t.tokens),
        "tokens_per_second": per_second(traces, t0, end),
        "fault": None,
    }
    if kill is None or not kill.killed:
        s["fault_error"] = kill.error if kill is not None else "the run ended before the fault"
        return s
    at = kill.at
    same = min(end, at + (at - t0))
    active = [t for t in traces if active_at(t, at)]
    latencies = [v for v in (next_token_after(t, at) for t in active) if v is not None]
    gaps = [longest_gap_after(t, at) for t in active if t.ok]
    interrupted = [t for t in active if not t.ok or longest_gap_after(t, at) > stall_s]
    s["fault"] = {
        **{k: v for k, v in asdict(kill).items() if k not in ("at", "error")},
        "at_s": at - t0,
        "victim_in_flight": kill.running + kill.waiting,
        "active_at_kill": len(active),
        "active_completed": sum(1 for t in active if t.ok),
        "active_failed": sum(1 for t in active if not t.ok),
        # Completed with no token after the kill: every token had arrived before it, and only
        # the stream's end (finish reason, usage) was left to send.
        "active_tail_only": sum(1 for t in active if t.ok and next_token_after(t, at) is None),
        "interrupted": len(interrupted),
        "stall_s": stall_s,
        "next_token_after_kill_ms": {
            "streams": len(latencies),
            "p50": percentile_ms(latencies, 0.5),
            "p99": percentile_ms(latencies, 0.99),
            "max": percentile_ms(latencies, 1.0),
        },
        # The stall a migrated stream sees: the first token after the kill may be one that
        # was already on its way.
        "longest_gap_after_kill_ms": {
            "streams": len(gaps),
            "p50": percentile_ms(gaps, 0.5),
            "p99": percentile_ms(gaps, 0.99),
            "max": percentile_ms(gaps, 1.0),
        },
        "median_gap_before_kill_ms": 1000 * median_gap_s(traces, at),
        # Tokens that reached clients in streams that then failed: work the fault threw away.
        "tokens_in_failed_streams": sum(t.tokens for t in active if not t.ok),
        "throughput_before": _rate(tokens_between(traces, t0, at), at - t0),
        "throughput_after": _rate(tokens_between(traces, at, end), end - at),
        # As long after the kill as before it: the tail of [kill, end) is the run draining.
        "throughput_after_same_length": _rate(tokens_between(traces, at, same), same - at),
        "whole_again_s": None if whole_at is None else max(0.0, whole_at - at),
        # Each active stream, for a closer look (times in s from t0, waits in ms).
        "active_streams": [
            {
                "sent_s": round(t.sent - t0, 4),
                "end_s": round(t.end - t0, 4),
                "status": t.status,
                "tokens": t.tokens,
                "next_token_ms": round(1000 * (next_token_after(t, at) or 0.0), 1),
                "longest_gap_ms": round(1000 * longest_gap_after(t, at), 1),
            }
            for t in active
        ],
    }
    return s


def fault_ok(summary: dict[str, Any]) -> bool:
    """The fault happened (its target is gone), and every request completed with exact
    usage."""
    f = summary["fault"]
    return (
        f is not None
        and f["pid_gone"]
        and summary["failed"] == 0
        and summary["usage_mismatches"] == 0
    )


def format_fault(summary: dict[str, Any]) -> str:
    s, f = summary, summary["fault"]
    rows = [
        f"fault: {s['requests']} requests, {s['completed']} completed, {s['failed']} failed"
        + (
            " (" + ", ".join(f"{k} {v}" for k, v in s["failed_by_status"].items()) + ")"
            if s["failed"]
            else ""
        )
        + f"; {s['output_tokens_received']} output tokens in {s['duration_s']:.1f} s"
    ]
    if f is None:
        rows.append(f"  no fault: {s.get('fault_error', '')}")
    else:
        n, g = f["next_token_after_kill_ms"], f["longest_gap_after_kill_ms"]
        whole = f["whole_again_s"]
        rows += [
            f"  killed the {_WHAT[f['kind']]} of replica {f['replica']} (pid {f['pid']}"
            f"{'' if f['pid_gone'] else ', STILL RUNNING'}) at "
            f"{f['at_s']:.2f} s; it had {f['running']} running + {f['waiting']} waiting "
            f"({f['replicas_seen']} replica(s) seen)",
            f"  streams active at the kill: {f['active_at_kill']}; {f['active_completed']} "
            f"completed, {f['active_failed']} failed; interrupted (failed, or a gap "
            f"> {f['stall_s']:g} s after the kill) {f['interrupted']}",
            f"  kill -> next token ({n['streams']} streams"
            + (
                f"; {f['active_tail_only']} had only their end left"
                if f["active_tail_only"]
                else ""
            )
            + f"): p50 {n['p50']:.0f} ms, p99 "
            f"{n['p99']:.0f} ms, max {n['max']:.0f} ms; longest gap after the kill "
            f"({g['streams']} completed streams): p50 {g['p50']:.0f} ms, p99 {g['p99']:.0f} ms, "
            f"max {g['max']:.0f} ms; median gap before the kill "
            f"{f['median_gap_before_kill_ms']:.0f} ms",
            f"  output tok/s: before the kill {f['throughput_before']:.1f}, after "
            f"{f['throughput_after']:.1f} (in as long after the kill as before it "
            f"{f['throughput_after_same_length']:.1f}); {f['tokens_in_failed_streams']} tokens "
            "sent in streams that then failed",
            "  service whole again: "
            + (f"{whole:.1f} s after the kill" if whole is not None else "not observed"),
        ]
    if s["usage_mismatches"]:
        rows.append(f"  usage != tokens received in {s['usage_mismatches']} completed stream(s)")
    if s["errors"]:
        rows.append("  errors: " + "; ".join(s["errors"]))
    return "\n".join(rows)
