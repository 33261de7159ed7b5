"""One backend's measurement (BenchResult), the ratios and table that compare them, and
the result JSON, shared by the benchmarks. Kept free of torch/transformers imports: this
module is reachable from `kvray --help`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchResult:
    """One backend's measurement over one workload."""

    backend: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    notes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. prefill tokens computed

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        d.update(
            requests_per_s=self.requests_per_s,
            output_tokens_per_s=self.output_tokens_per_s,
            total_tokens_per_s=self.total_tokens_per_s,
        )
        extra = d.pop("extra")
        d.update(extra)
        return d

    def line(self) -> str:
        return (
            f"{self.backend:>30}: {self.elapsed_s:8.2f} s  {self.requests_per_s:8.2f} req/s  "
            f"{self.output_tokens_per_s:10.1f} output tok/s  "
            f"{self.total_tokens_per_s:10.1f} total tok/s"
        )


_METRICS = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")


def ratios(num: BenchResult, den: BenchResult) -> dict[str, float]:
    """num/den for each throughput metric (>1: num is faster)."""
    return {m: getattr(num, m) / getattr(den, m) for m in _METRICS}


def format_table(
    results: Sequence[BenchResult],
    skipped: dict[str, str],
    comparisons: dict[str, dict[str, float]],
) -> str:
    """A plain-text table of every backend, skipped ones, then the requested ratios."""
    header = f"{'backend':<30} {'req/s':>10} {'output tok/s':>14} {'total tok/s':>14} {'time s':>9}"
    rows = [header, "-" * len(header)]
    for r in results:
        rows.append(
            f"{r.backend:<30} {r.requests_per_s:>10.2f} {r.output_tokens_per_s:>14.1f} "
            f"{r.total_tokens_per_s:>14.1f} {r.elapsed_s:>9.2f}"
        )
    for name, why in skipped.items():
        rows.append(f"{name:<30} skipped: {why}")
    if comparisons:
        rows += ["", f"{'ratio':<30} {'req/s':>10} {'output tok/s':>14} {'total tok/s':>14}"]
        for name, r in comparisons.items():
            rows.append(
                f"{name:<30} {r['requests_per_s']:>10.2f}x {r['output_tokens_per_s']:>13.2f}x "
                f"{r['total_tokens_per_s']:>13.2f}x"
            )
    return "\n".join(rows)


def write_result_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
