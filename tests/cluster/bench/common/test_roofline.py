"""The roofline figures of `kvray bench throughput` (cluster/bench/common/roofline.py)."""

from __future__ import annotations

import math

import torch
from safetensors import safe_open

from cluster.bench.common.result import BenchResult
from cluster.bench.common.roofline import (
    MatmulPeak,
    ModelShape,
    WorkloadFlops,
    measure_amx_peak,
    measure_matmul_peak,
    report,
    workload_flops,
)
from cluster.bench.common.workload import BenchRequest, Workload

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_shape_counts_the_checkpoints_matmul_weights(demo_dir) -> None:
    shape = ModelShape.from_dir(demo_dir)
    with safe_open(str(demo_dir / "model.safetensors"), "pt") as f:
        counted = sum(
            math.prod(f.get_slice(name).get_shape())
            for name in f.keys()  # noqa: SIM118 - safe_open has no __iter__
            if name.endswith(".weight") and any(p in name for p in PROJECTIONS)
        )
    assert shape.layers * shape.layer_matmul_params == counted


def test_workload_flops_count_fed_tokens_sampled_rows_and_attended_positions() -> None:
    shape = ModelShape(
        hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10
    )
    # q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16
    assert shape.layer_matmul_params == 64 + 32 + 32 + 64 + 3 * 128
    # Prompt 3 + output 2: 4 tokens fed (the last output is never fed back), 2 rows sampled,
    # positions 0..3 attend to 1+2+3+4 = 10 positions.
    w = Workload("t", (BenchRequest((5, 6, 7), 2),))
    flops = workload_flops(shape, w)
    assert flops.linear == 2 * 2 * shape.layer_matmul_params * 4 + 2 * 10 * 8 * 2
    assert flops.attention == 4 * 2 * 2 * 4 * 10
    assert flops.total == flops.linear + flops.attention


def test_matmul_peak_is_measured_with_the_runs_threads() -> None:
    peak = measure_matmul_peak("cpu", size=128, seconds=0.05)
    assert math.isfinite(peak.flops_per_s) and peak.flops_per_s > 0
    assert peak.threads == torch.get_num_threads() and peak.size == 128
    assert "float32 matmul peak" in peak.describe()


def test_report_gives_each_backend_its_share_of_the_peak() -> None:
    flops = WorkloadFlops(linear=3e9, attention=1e9)
    peak = MatmulPeak(8e9, 2048, "float32", "cpu", 2)
    fast = BenchResult("kvray", elapsed_s=1.0, num_requests=1, prompt_tokens=1, output_tokens=1)
    slow = BenchResult("hf", elapsed_s=4.0, num_requests=1, prompt_tokens=1, output_tokens=1)
    lines, payload = report([fast, slow], flops, peak)
    assert fast.extra["achieved_flops_per_s"] == 4e9 and fast.extra["share_of_matmul_peak"] == 0.5
    assert slow.extra["share_of_matmul_peak"] == 0.125
    assert any("50.0 % of the matmul peak" in line for line in lines)
    assert payload["matmul_peak_flops_per_s"] == 8e9 and payload["torch_threads"] == 2
    # Without a measured peak the achieved FLOP/s are still reported.
    lines, payload = report([fast], flops, None)
    assert "share_of_matmul_peak" not in payload and "GFLOP/s" in lines[-1]


def test_amx_peak_is_measured_where_the_engine_runs_on_amx() -> None:
    from workers.device.layers.cpu_kernels import amx, kernel

    lib = kernel()
    peak = measure_amx_peak(size=128, seconds=0.05)
    if lib is None or not amx(lib):
        assert peak is None
        return
    assert math.isfinite(peak.flops_per_s) and peak.flops_per_s > 0
    assert "float32-accurate AMX matmul peak" in peak.describe() and "amx_linear" in peak.describe()


def test_report_gives_backends_on_amx_their_share_of_the_amx_peak() -> None:
    flops = WorkloadFlops(linear=3e9, attention=1e9)
    peak = MatmulPeak(8e9, 2048, "float32", "cpu", 2)
    amx_peak = MatmulPeak(16e9, 2048, "float32-accurate AMX", "cpu", 2, "amx_linear")
    kvray = BenchResult("kvray", 1.0, 1, 1, 1, extra={"amx": True})
    hf = BenchResult("hf", 4.0, 1, 1, 1)
    lines, payload = report([kvray, hf], flops, peak, amx_peak)
    assert kvray.extra["share_of_matmul_peak"] == 0.5 and kvray.extra["share_of_amx_peak"] == 0.25
    assert "share_of_amx_peak" not in hf.extra  # torch's float32 GEMMs: the FMA peak only
    assert any("amx_linear 2048x2048" in line for line in lines)
    assert "25.0 % of the AMX peak" in lines[-2] and "AMX" not in lines[-1]
    assert payload["amx_matmul_peak_flops_per_s"] == 16e9
