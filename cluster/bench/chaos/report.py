"""The statistics and the printed report of `kvray bench serve --chaos` (pure functions).

- requests sent, completed, failed (by status; `unclear`: without OpenAI's error body) and
  lost (no answer: connection error, timeout, truncated stream), with the top messages;
- changed outputs: completed requests whose answer differs from the offline engine's
  (chaos_expected.changes), and the structured ones' schema checks;
- TTFT (streamed requests) and end-to-end latency per priority, p50 / p99;
- per tenant: requests sent and completed, output tokens, and its share of the completed
  requests and of their output tokens;
- the faults: planned, injected (time, kind, victim, time to repair), not injected and why,
  the closest two; and the migrations the routers counted meanwhile.

`chaos_ok`: nothing lost and no output changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from cluster.bench.chaos.client import ERROR, LOST, OK, ChaosResult
from cluster.bench.chaos.expected import Expected, changes
from cluster.bench.chaos.faults import Fault
from cluster.bench.serve.overload import percentile_ms

SHOWN = 10  # changed outputs and lost requests listed by name


def _latency(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": percentile_ms(values, 0.5),
        "p99": percentile_ms(values, 0.99),
    }


def _by_priority(results: Sequence[ChaosResult]) -> dict[str, Any]:
    prios = sorted({r.request.priority for r in results})
    out = {}
    for p in prios:
        ok = [r for r in results if r.outcome == OK and r.request.priority == p]
        out[str(p)] = {
            "ttft_ms": _latency([r.ttft for r in ok if r.ttft is not None]),
            "e2e_ms": _latency([r.e2e for r in ok]),
        }
    return out


def _tenants(results: Sequence[ChaosResult], names: Sequence[str]) -> dict[str, Any]:
    ok = [r for r in results if r.outcome == OK]
    done, tokens = len(ok), sum(r.completion_tokens for r in ok)
    out = {}
    for t, name in enumerate(names):
        mine = [r for r in ok if r.request.tenant == t]
        mine_tokens = sum(r.completion_tokens for r in mine)
        out[name] = {
            "sent": sum(1 for r in results if r.request.tenant == t),
            "completed": len(mine),
            "output_tokens": mine_tokens,
            "request_share": len(mine) / done if done else 0.0,
            "output_token_share": mine_tokens / tokens if tokens else 0.0,
        }
    return out


def _alone_note(res: ChaosResult, batch: Expected, alone: Expected | None) -> tuple[str, bool]:
    """What the offline engine answers when it runs the request alone, and whether that shows
    its numerics depend on the batch (its answer alone is not its answer in the batch)."""
    if alone is None:
        return "", False
    if alone.text == res.text:
        return "run alone, the offline engine gives the served text", True
    if alone.text == batch.text:
        return "run alone, the offline engine gives its batch answer again", False
    return "run alone, the offline engine gives a third text", True


def _outputs(
    results: Sequence[ChaosResult],
    expected: Mapping[int, Expected] | str,
    alone: Mapping[int, Expected],
) -> dict[str, Any]:
    ok = [r for r in results if r.outcome == OK]
    changed, batch_dependent = [], 0
    for r in ok if not isinstance(expected, str) else ():
        want = expected.get(r.request.index)
        found = ["no offline answer to compare with"] if want is None else changes(r, want)
        if found and want is not None:
            note, dependent = _alone_note(r, want, alone.get(r.request.index))
            found += [note] if note else []
            batch_dependent += dependent
        if found:
            changed.append(f"{r.request.describe()}: {'; '.join(found)}")
    structured = [r for r in ok if r.request.structured]
    return {
        # Why nothing was compared ("" when all was): the offline engine failed.
        "not_compared": expected if isinstance(expected, str) else "",
        "compared": 0 if isinstance(expected, str) else len(ok),
        "greedy": sum(1 for r in ok if r.request.seed is None),
        "seeded": sum(1 for r in ok if r.request.seed is not None),
        "changed": len(changed),
        # Changed outputs whose request gets another answer from the offline engine itself
        # when it runs alone than in a batch: float rounding that depends on the batch.
        "changed_batch_dependent": batch_dependent,
        "changes": changed[:SHOWN],
        "structured": {
            "completed": len(structured),
            "finished_by_grammar": sum(1 for r in structured if r.finish_reason == "stop"),
            "hit_max_tokens": sum(1 for r in structured if r.finish_reason == "length"),
        },
    }


def _faults(faults: Sequence[Fault], planned: int) -> dict[str, Any]:
    done = [f for f in faults if f.killed]
    times = sorted(f.at_s for f in done if f.at_s is not None)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    repaired = [f.repaired_s for f in done if f.repaired_s is not None]
    return {
        "planned": planned,
        "injected": len(done),
        "by_kind": dict(Counter(f.kind for f in done)),
        "not_injected": [
            f"{f.kind} at {f.planned_s:.1f} s: {f.error}" for f in faults if not f.killed
        ],
        "targets_still_running": sum(1 for f in done if not f.pid_gone),
        "closest_gap_s": min(gaps) if gaps else None,
        "repaired": len(repaired),
        "repair_s": {
            "p50": percentile_ms(repaired, 0.5) / 1000,
            "max": max(repaired) if repaired else 0.0,
        },
        "list": [asdict(f) for f in faults],
    }


def summarize_chaos(
    results: Sequence[ChaosResult],
    expected: Mapping[int, Expected] | str,
    faults: Sequence[Fault],
    *,
    planned: int,
    tenant_names: Sequence[str],
    t0: float,
    stop: float,
    end: float,
    migrations: Mapping[str, int] | None,
    alone: Mapping[int, Expected] | None = None,
) -> dict[str, Any]:
    """The report of one chaos run: `t0` the start of the timed run, `stop` when sending
    stopped, `end` the last answer (perf_counter seconds); `expected` by request index, or
    why there is none (the offline engine failed: nothing is compared, and the run is not ok);
    `alone`: the offline engine's answers to changed requests, each run alone."""
    failed = [r for r in results if r.outcome == ERROR]
    lost = [r for r in results if r.outcome == LOST]
    ok = [r for r in results if r.outcome == OK]
    messages = Counter(f"{r.status}: {r.error}" for r in failed)
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "duration_s": stop - t0,
        "drain_s": max(0.0, end - stop),
        "requests": {
            "sent": len(results),
            "completed": len(ok),
            "failed": len(failed),
            "lost": len(lost),
            "failed_by_status": dict(Counter(r.status for r in failed).most_common()),
            "unclear_errors": sum(1 for r in failed if not r.clear),
            "lost_by_reason": dict(Counter(r.status for r in lost).most_common()),
            "errors": [f"{n} x {m}" for m, n in messages.most_common(5)],
            "lost_examples": [
                f"{r.request.describe()}: {r.status}: {r.error}" for r in lost[:SHOWN]
            ],
        },
        "outputs": _outputs(results, expected, alone or {}),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / (end - t0) if end > t0 else 0.0,
        "by_priority": _by_priority(results),
        "tenants": _tenants(results, tenant_names),
        "faults": _faults(faults, planned),
        "migrations": None if migrations is None else dict(migrations),
    }


def chaos_ok(summary: Mapping[str, Any]) -> bool:
    """Nothing lost and no output changed (every completed one compared)."""
    o = summary["outputs"]
    return summary["requests"]["lost"] == 0 and o["changed"] == 0 and not o["not_compared"]


def format_chaos(s: Mapping[str, Any]) -> str:
    q, o, f = s["requests"], s["outputs"], s["faults"]
    failed = ", ".join(f"{k} {v}" for k, v in q["failed_by_status"].items())
    lost = ", ".join(f"{k} {v}" for k, v in q["lost_by_reason"].items())
    rows = [
        f"chaos: {q['sent']} requests in {s['duration_s']:.0f} s (+{s['drain_s']:.1f} s to "
        f"drain): {q['completed']} completed, {q['failed']} failed"
        + (f" ({failed})" if failed else "")
        + f", {q['lost']} lost"
        + (f" ({lost})" if lost else "")
        + f"; {s['output_tokens']} output tokens, {s['output_tokens_per_s']:.1f} tok/s",
        f"  outputs: {o['compared']} compared with the offline engine ({o['greedy']} greedy, "
        f"{o['seeded']} seeded), {o['changed']} changed"
        + (
            f" ({o['changed_batch_dependent']} where the offline engine's own answer depends "
            "on the batch)"
            if o["changed_batch_dependent"]
            else ""
        )
        + "; structured: "
        f"{o['structured']['completed']} completed, {o['structured']['finished_by_grammar']} "
        f"closed their JSON (validated), {o['structured']['hit_max_tokens']} hit max_tokens",
        f"  faults: {f['injected']} of {f['planned']} planned injected ("
        + ", ".join(f"{k} {v}" for k, v in sorted(f["by_kind"].items()))
        + ")"
        + (f", closest two {f['closest_gap_s']:.1f} s apart" if f["closest_gap_s"] else "")
        + f"; repaired {f['repaired']} (p50 {f['repair_s']['p50']:.1f} s, max "
        f"{f['repair_s']['max']:.1f} s)",
    ]
    for fault in f["list"]:
        if fault["at_s"] is not None and not fault["error"]:
            rep = fault["repaired_s"]
            rows.append(
                f"    t={fault['at_s']:6.1f} s  {fault['kind']:<7} replica {fault['replica']} "
                f"pid {fault['pid']}"
                + ("" if fault["pid_gone"] else " STILL RUNNING")
                + (f", serving again after {rep:.1f} s" if rep is not None else ", not repaired")
            )
    rows += [f"    not injected: {x}" for x in f["not_injected"]]
    mig = s["migrations"]
    rows.append(
        "  migrations (the routers' kvray_request_migrations_total): "
        + (
            "unknown (no Ray metrics endpoint)"
            if mig is None
            else (", ".join(f"{k} {v}" for k, v in mig.items()) or "0")
        )
    )
    rows.append("  per priority: TTFT p50 / p99 (streamed), E2E p50 / p99:")
    for p, v in s["by_priority"].items():
        t, e = v["ttft_ms"], v["e2e_ms"]
        rows.append(
            f"    {p:>3}: TTFT {t['p50']:.0f} / {t['p99']:.0f} ms ({t['n']}), E2E {e['p50']:.0f} "
            f"/ {e['p99']:.0f} ms ({e['n']})"
        )
    rows.append("  per tenant: completed requests, share of completed requests / output tokens:")
    for name, v in s["tenants"].items():
        rows.append(
            f"    {name}: {v['completed']} of {v['sent']} sent, {100 * v['request_share']:.1f} % "
            f"/ {100 * v['output_token_share']:.1f} %"
        )
    if q["errors"]:
        rows.append("  errors: " + "; ".join(q["errors"]))
    if q["unclear_errors"]:
        rows.append(f"  {q['unclear_errors']} error(s) without OpenAI's error body")
    if o["not_compared"]:
        rows.append(f"  OUTPUTS NOT COMPARED: {o['not_compared']}")
    rows += [f"  LOST {x}" for x in q["lost_examples"]]
    rows += [f"  CHANGED {x}" for x in o["changes"]]
    return "\n".join(rows)
