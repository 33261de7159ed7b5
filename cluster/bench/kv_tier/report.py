"""What `kvray bench kv-tier` prints and writes: TTFT percentiles per arm and prefix length,
the ratios that say what the tier buys, where pulling starts to win, whether the learned cost
model (the auto arm) picked the faster of pull and recompute, and its estimates beside the
measured times. No torch or Ray here (reachable from `kvray --help`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# (key, column title, what it is)
ARMS: tuple[tuple[str, str, str], ...] = (
    ("local", "local hit", "the replica that computed the prefix serves prefix + new suffix"),
    ("pull", "peer pull", "a replica that never saw the prefix pulls it (forced)"),
    ("recompute", "recompute", "a replica without the tier computes it"),
    ("auto", "auto", "a replica with the learned cost model decides"),
    ("failover_pull", "failover pull", "next token after a mid-stream stop, resumed with the tier"),
    ("failover_recompute", "failover recomp", "the same, resumed on a replica without the tier"),
)
ARM_KEYS = tuple(k for k, _, _ in ARMS)
# Pull and recompute within this share of each other: a tie (picked_faster).
TIE = 0.1


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples: dict[int, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per prefix length: each arm's TTFT p50/p99 (ms) and the ratios of the medians."""
    out: dict[str, Any] = {}
    for length, arms in samples.items():
        row: dict[str, Any] = {}
        for arm in ARM_KEYS:
            ttfts = [s["ttft_s"] * 1e3 for s in arms.get(arm, []) if s.get("ttft_s") is not None]
            row[arm] = {"p50_ms": percentile(ttfts, 50), "p99_ms": percentile(ttfts, 99)}
        row["pull_over_recompute"] = _ratio(row["pull"], row["recompute"])
        row["failover_pull_over_recompute"] = _ratio(
            row["failover_pull"], row["failover_recompute"]
        )
        row["local_over_recompute"] = _ratio(row["local"], row["recompute"])
        pulled = [s["pulled_blocks"] for s in arms.get("pull", [])]
        row["pull_blocks"] = min(pulled) if pulled else 0
        fo = [s["pulled_blocks"] for s in arms.get("failover_pull", [])]
        row["failover_pull_blocks"] = min(fo) if fo else 0
        auto = arms.get("auto", [])
        row["auto_outcomes"] = {
            o: sum(1 for s in auto if s.get("outcome") == o)
            for o in {s.get("outcome") for s in auto}
        }
        row["auto_est_pull_ms"] = _median([s.get("est_pull_s") for s in auto])
        row["auto_est_compute_ms"] = _median([s.get("est_compute_s") for s in auto])
        row["auto_picked_faster"] = picked_faster(
            arms.get("pull", []), arms.get("recompute", []), auto
        )
        out[str(length)] = row
    return out


def picked_faster(
    pull: Sequence[dict[str, Any]],
    recompute: Sequence[dict[str, Any]],
    auto: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """In how many rounds the auto arm chose the faster of pulling and recomputing.

    Round i's faster choice is the arm (forced pull or recompute) with the lower measured
    TTFT; auto chose to pull when its outcome is "pulled", to recompute otherwise (a miss or
    a failed pull computes too). A round whose two arms are within TIE of each other is a
    tie, counted apart (`ties`): one round's noise decides which is faster, and either choice
    is as fast. A round missing a TTFT is left out."""
    right = rounds = ties = 0
    for p, r, a in zip(pull, recompute, auto, strict=True):
        if p.get("ttft_s") is None or r.get("ttft_s") is None:
            continue
        if abs(p["ttft_s"] - r["ttft_s"]) <= TIE * min(p["ttft_s"], r["ttft_s"]):
            ties += 1
            continue
        rounds += 1
        if (p["ttft_s"] < r["ttft_s"]) == (a.get("outcome") == "pulled"):
            right += 1
    return {**_share(right, rounds), "ties": ties}


def picked_faster_overall(summary: dict[str, Any]) -> dict[str, Any]:
    """picked_faster over every prefix length of `summary`."""
    rows = [row["auto_picked_faster"] for row in summary.values()]
    right, rounds = sum(r["right"] for r in rows), sum(r["rounds"] for r in rows)
    return {**_share(right, rounds), "ties": sum(r["ties"] for r in rows)}


def _share(right: int, rounds: int) -> dict[str, Any]:
    return {"right": right, "rounds": rounds, "share": right / rounds if rounds else math.nan}


def _ratio(a: dict[str, float], b: dict[str, float]) -> float:
    return a["p50_ms"] / b["p50_ms"] if b["p50_ms"] and not math.isnan(b["p50_ms"]) else math.nan


def _median(values: list[float | None]) -> float:
    xs = [v * 1e3 for v in values if v is not None]
    return percentile(xs, 50)


def crossover(lengths: Sequence[int], ratios: Sequence[float]) -> tuple[float | None, str]:
    """Where a ratio (tier / recompute) first drops below 1, interpolated linearly between
    the measured lengths: (length or None, how to say it)."""
    pts = [(n, r) for n, r in zip(lengths, ratios, strict=True) if not math.isnan(r)]
    if not pts:
        return None, "not measured"
    if pts[0][1] < 1:
        return None, f"below the smallest measured length ({pts[0][0]} tokens)"
    for (n0, r0), (n1, r1) in zip(pts, pts[1:], strict=False):
        if r1 < 1 <= r0:
            at = n0 + (r0 - 1) * (n1 - n0) / (r0 - r1)
            return at, f"~{at:.0f} tokens (interpolated between {n0} and {n1})"
    return None, "not within the measured lengths"


def tables(summary: dict[str, Any]) -> str:
    lengths = [int(k) for k in summary]
    head = f"{'prefix':>7} " + " ".join(f"{t:>21}" for _, t, _ in ARMS)
    sub = f"{'tokens':>7} " + " ".join(f"{'p50 / p99 ms':>21}" for _ in ARMS)
    lines = ["TTFT (time to the next token for the failover arms)", head, sub]
    for n in lengths:
        row = summary[str(n)]
        cells = [f"{row[a]['p50_ms']:>10.1f} / {row[a]['p99_ms']:<8.1f}" for a in ARM_KEYS]
        lines.append(f"{n:>7} " + " ".join(f"{c:>21}" for c in cells))
    lines += [
        "",
        f"{'prefix':>7} {'pull/recompute':>15} {'failover p/r':>13} {'local/recompute':>16} "
        f"{'blocks pulled':>14}",
    ]
    for n in lengths:
        row = summary[str(n)]
        pull, fo = row["pull_over_recompute"], row["failover_pull_over_recompute"]
        lines.append(
            f"{n:>7} {pull:>14.2f}x {fo:>12.2f}x {row['local_over_recompute']:>15.2f}x"
            f" {row['pull_blocks']:>14}"
        )
    lines += ["", *auto_table(summary)]
    _, pull_at = crossover(lengths, [summary[str(n)]["pull_over_recompute"] for n in lengths])
    _, fo_at = crossover(
        lengths, [summary[str(n)]["failover_pull_over_recompute"] for n in lengths]
    )
    lines += ["", f"pulling beats recomputing from: {pull_at}", f"failover, the same: {fo_at}"]
    return "\n".join(lines)


def auto_table(summary: dict[str, Any]) -> list[str]:
    """The auto arm: what it chose, whether that was the faster arm, and its cost model's
    estimates beside the measured medians of the forced pull and the recompute arm."""
    lines = [
        "auto (the learned cost model): its choice, and its estimates beside the measured p50s",
        f"{'prefix':>7} {'auto chose':>22} {'picked the faster':>18} {'pull est / meas ms':>20}"
        f" {'compute est / meas ms':>23}",
    ]
    for n in (int(k) for k in summary):
        row = summary[str(n)]
        chose = ", ".join(f"{k} {v}" for k, v in sorted(row["auto_outcomes"].items(), key=str))
        est_pull = f"{row['auto_est_pull_ms']:.1f} / {row['pull']['p50_ms']:.1f}"
        est_comp = f"{row['auto_est_compute_ms']:.1f} / {row['recompute']['p50_ms']:.1f}"
        lines.append(
            f"{n:>7} {chose:>22} {_of(row['auto_picked_faster']):>18} {est_pull:>20} {est_comp:>23}"
        )
    overall = picked_faster_overall(summary)
    lines.append(
        f"auto picked the faster of pull and recompute in {_of(overall)} rounds where they "
        f"differ by more than {TIE:.0%} ({overall['ties']} closer rounds: ties, not counted; "
        "the estimates: the pull after its lookup and the prefill's marginal cost; measured: "
        "whole TTFTs)"
    )
    return lines


def _of(got: dict[str, Any]) -> str:
    share = "n/a" if math.isnan(got["share"]) else f"{got['share'] * 100:.0f} %"
    return f"{got['right']} of {got['rounds']} ({share})"
