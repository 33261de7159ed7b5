"""Roofline figures for `kvray bench throughput`: how much of the machine a backend uses.

The machine's dense matmul peak is measured in the same run (torch.mm on large square
matrices, warm, with the threads the backends use), and the workload's useful FLOPs are
counted from the model's shape; a backend's achieved FLOP/s is that count over its elapsed
time. Useful work is the same for every backend (padding and tokens a static batch generates
past a request's end are not counted), so the shares compare like the tok/s figures do.

FLOPs of one request with prompt P and output O: it feeds n = P + O - 1 tokens through the
model (the last generated token is never fed back) and samples O of them:
- linear layers: 2 * (non-embedding matmul weights) per fed token, plus 2 * vocab * hidden
  per sampled row for the LM head (only sampled rows get logits);
- attention: a token at position p attends to p + 1 positions, 2 * heads * head_dim FLOPs
  each for q.k and as many for p.v, in every layer.
The embedding lookup, norms and activations are not matmuls and are left out. Prompt tokens
served from a prefix cache count as work done: the figure compares backends on one workload
(on the shared-prefix workload it is not the FLOP/s the hardware ran).

Kept free of torch at import: this module is reachable from `kvray --help`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench.common.result import BenchResult
from cluster.bench.common.workload import Workload

PEAK_SIZE_CPU = 2048
PEAK_SIZE_CUDA = 8192


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelShape:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return ModelShape(
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg.get("intermediate_size", 4 * hidden)),
            vocab=int(cfg["vocab_size"]),
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matmuls: q/k/v, o, gate/up and down projections."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate


@dataclass(frozen=True)
class WorkloadFlops:
    linear: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.attention


def workload_flops(shape: ModelShape, workload: Workload) -> WorkloadFlops:
    """The useful FLOPs of running `workload` (see the module docstring for the counting)."""
    fed = 0
    attended = 0  # sum over fed tokens of the positions each attends to
    sampled = 0
    for req in workload.requests:
        n = req.prompt_len + req.output_len - 1
        fed += n
        attended += n * (n + 1) // 2
        sampled += req.output_len
    linear = 2.0 * shape.layers * shape.layer_matmul_params * fed
    linear += 2.0 * shape.vocab * shape.hidden * sampled
    attention = 4.0 * shape.layers * shape.heads * shape.head_dim * attended
    return WorkloadFlops(linear=linear, attention=attention)


@dataclass(frozen=True)
class MatmulPeak:
    flops_per_s: float
    size: int
    dtype: str
    device: str
    threads: int
    op: str = "torch.mm"

    def describe(self) -> str:
        return (
            f"{self.dtype} matmul peak {self.flops_per_s / 1e9:,.1f} GFLOP/s "
            f"({self.op} {self.size}x{self.size}, {self.device}, {self.threads} torch threads)"
        )


def measure_matmul_peak(
    device: str, dtype: str = "float32", size: int | None = None, seconds: float = 1.0
) -> MatmulPeak:
    """The best FLOP/s of torch.mm on two size x size matrices (`_best_flops`)."""
    import torch

    size = size or (PEAK_SIZE_CUDA if device.startswith("cuda") else PEAK_SIZE_CPU)
    tdtype = getattr(torch, dtype)
    a = torch.randn(size, size, device=device).to(tdtype)
    b = torch.randn(size, size, device=device).to(tdtype)
    out = torch.empty(size, size, device=device, dtype=tdtype)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    best = _best_flops(lambda: torch.mm(a, b, out=out), 2.0 * size**3, seconds, sync)
    return MatmulPeak(best, size, dtype, device, torch.get_num_threads())


def _best_flops(
    step: Callable[[], object],
    flop: float,
    seconds: float,
    sync: Callable[[], None] = lambda: None,
) -> float:
    """The best FLOP/s of `step` (one op of `flop` FLOPs; `sync` waits for the device), after a
    warm-up, over 5 timed rounds of about `seconds` in all (best, not mean: the peak is what
    the machine can do; a round slowed by a neighbour says nothing about it)."""
    step()  # warm: thread pool, kernel choice, caches
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    one = max(time.perf_counter() - t0, 1e-9)
    per_round = max(1, int(seconds / 5 / one))
    best = flop / one
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(per_round):
            step()
        sync()
        best = max(best, flop * per_round / max(time.perf_counter() - t0, 1e-9))
    return best


def measure_amx_peak(size: int = PEAK_SIZE_CPU, seconds: float = 1.0) -> MatmulPeak | None:
    """The best FLOP/s of the engine's float32-accurate AMX GEMM (csrc/amx_linear.c: x in three
    bfloat16 pieces, weights on the bfloat16 grid) on size x size matrices, timed as torch.mm
    is (`_best_flops`); None where this CPU, build or kernel has no AMX.
    kvray runs a bfloat16 checkpoint's linear layers on it there, so its share of the
    float32 (FMA) peak alone would not say how close it runs to the hardware."""
    import torch

    from workers.device.layers.cpu_kernels import amx, bf16_linear, kernel, pack_bf16_weight

    lib = kernel()
    if lib is None or not amx(lib):
        return None
    x = torch.randn(size, size)
    packed = pack_bf16_weight(torch.randn(size, size).bfloat16().float(), amx=True)
    out = torch.empty(size, size)  # into one output, as torch.mm's peak is timed
    best = _best_flops(lambda: bf16_linear(lib, x, packed, size, None, out), 2.0 * size**3, seconds)
    op = "amx_linear, x in 3 bfloat16 pieces"
    return MatmulPeak(best, size, "float32-accurate AMX", "cpu", torch.get_num_threads(), op)


def annotate(
    result: BenchResult,
    flops: WorkloadFlops,
    peak: MatmulPeak | None,
    amx_peak: MatmulPeak | None = None,
) -> str:
    """Adds the achieved FLOP/s (and share of the peak) to `result.extra`; returns a line.
    A backend that ran on AMX (`extra["amx"]`) also gets its share of `amx_peak`."""
    achieved = flops.total / result.elapsed_s
    result.extra["achieved_flops_per_s"] = achieved
    line = f"{result.backend:>30}: {achieved / 1e9:10.2f} GFLOP/s"
    if peak is not None:
        share = achieved / peak.flops_per_s
        result.extra["share_of_matmul_peak"] = share
        line += f"  {100 * share:5.1f} % of the matmul peak"
    if amx_peak is not None and result.extra.get("amx"):
        share = achieved / amx_peak.flops_per_s
        result.extra["share_of_amx_peak"] = share
        line += f", {100 * share:5.1f} % of the AMX peak"
    return line


def report(
    results: list[BenchResult],
    flops: WorkloadFlops,
    peak: MatmulPeak | None,
    amx_peak: MatmulPeak | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """The roofline section of the command's output and its JSON payload."""
    lines = [
        f"roofline: workload {flops.total / 1e9:,.2f} GFLOP useful work "
        f"(linear {flops.linear / 1e9:,.2f} + attention {flops.attention / 1e9:,.2f})"
    ]
    lines.extend(f"          {p.describe()}" for p in (peak, amx_peak) if p is not None)
    lines.extend(annotate(res, flops, peak, amx_peak) for res in results)
    payload: dict[str, Any] = {
        "workload_flops": flops.total,
        "workload_linear_flops": flops.linear,
        "workload_attention_flops": flops.attention,
    }
    if peak is not None:
        payload.update(
            matmul_peak_flops_per_s=peak.flops_per_s,
            matmul_peak_size=peak.size,
            matmul_peak_dtype=peak.dtype,
            torch_threads=peak.threads,
        )
    if amx_peak is not None:
        payload["amx_matmul_peak_flops_per_s"] = amx_peak.flops_per_s
    return lines, payload
