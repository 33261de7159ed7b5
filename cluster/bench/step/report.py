"""What `kvray bench step` reports: the machine it measured on, the device's copy bandwidth,
the rows of the table and the result JSON.

A row's share of the memory-bandwidth roofline is the bytes the step must read at least
(every weight once, the K/V of every position attended once) over its device time, against
the bandwidth of a large tensor copy on the same device (bytes read + bytes written), so 100 %
is a step that streams its inputs as fast as a plain copy does.

Kept free of torch at import: this module is reachable from `kvray --help`.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

COPY_MIB = 256


@dataclass(frozen=True)
class StepRow:
    """One case of the table: a decode batch or the prefill chunk."""

    case: str  # "decode" or "prefill"
    batch: int  # sequences in the step
    tokens: int  # tokens the step feeds
    context: float  # positions attended per sequence, mean over the timed steps
    step_ms: list[float]  # LLMEngine.step() wall time of each timed step
    execute_ms: list[float]  # Worker.execute wall time of each timed step
    device_ms: list[float]  # forward + sample: CUDA events; on CPU the host wall of that span
    ops: int  # CPU: ops dispatched (TorchDispatchMode); CUDA: kernels run (torch.profiler)
    layers: int
    weight_bytes: int  # weights read by one step: each matmul weight once, embedding rows
    kv_bytes: float  # K/V read by one step, mean over the timed steps
    copy_bytes_per_s: float  # the device's copy bandwidth (read + write)
    ops_by_name: dict[str, int] = field(default_factory=dict)  # the most frequent ops
    launches: int | None = None  # CUDA: kernel and graph launch calls on the host
    kernel_busy_ms: float | None = None  # CUDA: sum of the kernels' own durations

    @property
    def ops_per_layer(self) -> float:
        return self.ops / self.layers

    @property
    def bytes_read(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_read / (median(self.device_ms) / 1e3)

    @property
    def roofline_share(self) -> float:
        return self.bytes_per_s / self.copy_bytes_per_s

    @property
    def label(self) -> str:
        return f"decode B={self.batch}" if self.case == "decode" else f"prefill {self.tokens}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            step_ms_median=median(self.step_ms),
            execute_ms_median=median(self.execute_ms),
            device_ms_median=median(self.device_ms),
            ops_per_layer=self.ops_per_layer,
            bytes_read=self.bytes_read,
            bytes_per_s=self.bytes_per_s,
            roofline_share=self.roofline_share,
        )
        return d


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine_info(device: str) -> dict[str, Any]:
    """What the figures were measured on: CPU model and count, torch threads and version, the
    GPU's name on CUDA, the load average when the run started, the date (UTC)."""
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1m": os.getloadavg()[0],
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def describe_machine(info: dict[str, Any]) -> str:
    gpu = f", {info['gpu']}" if "gpu" in info else ""
    return (
        f"measured on: {info['cpu']} ({info['cpu_count']} CPUs, {info['torch_threads']} torch "
        f"threads){gpu}, torch {info['torch']}, load average {info['load_average_1m']:.1f}, "
        f"{info['date']}"
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: the platform's own word for it
        pass
    return platform.processor() or platform.machine()


def copy_bandwidth(device: str, mib: int = COPY_MIB, repeats: int = 5) -> float:
    """Bytes per second (read + written) of copying a `mib` MiB tensor on `device`, the best
    of `repeats` after a warm-up copy: what a step that only streamed memory could reach."""
    import torch

    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    cuda = src.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(src.device)

    dst.copy_(src)  # warm: page faults, the copy's threads
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def format_table(rows: list[StepRow], cuda: bool) -> str:
    """One line per case: medians of the timed steps, ops, bytes read, GB/s, roofline share."""
    ops = "kernels" if cuda else "ops"
    header = (
        f"{'case':<16}{'context':>9}{'step ms':>10}{'execute ms':>12}{'device ms':>11}"
        f"{ops:>9}{ops + '/layer':>14}{'MB read':>10}{'GB/s':>8}{'roofline':>10}"
    )
    if cuda:
        header += f"{'busy ms':>9}{'launches':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (
            f"{r.label:<16}{r.context:>9.0f}{median(r.step_ms):>10.2f}"
            f"{median(r.execute_ms):>12.2f}{median(r.device_ms):>11.2f}{r.ops:>9}"
            f"{r.ops_per_layer:>14.1f}{r.bytes_read / 1e6:>10.1f}{r.bytes_per_s / 1e9:>8.2f}"
            f"{100 * r.roofline_share:>9.1f}%"
        )
        if cuda:
            busy = "" if r.kernel_busy_ms is None else f"{r.kernel_busy_ms:.2f}"
            line += f"{busy:>9}{'' if r.launches is None else r.launches:>10}"
        lines.append(line)
    return "\n".join(lines)


def timing_notes(cuda: bool) -> list[str]:
    """What each column measured, printed under the table and stored in the JSON."""
    device = (
        "device ms: torch.cuda.Event from the start of the forward to after sampling"
        if cuda
        else "device ms: on CPU the host wall time of the forward and sampling (the device "
        "is the host)"
    )
    ops = (
        "kernels: CUDA kernels run in one step (torch.profiler); launches: the host's "
        "kernel and graph launch calls; busy ms: the kernels' own durations summed"
        if cuda
        else "ops: torch ops dispatched in one step (TorchDispatchMode; aten and kvray:: "
        "custom ops; the direct C kernel calls of the CPU layers are not torch ops)"
    )
    return [
        "step ms: wall time of LLMEngine.step() (schedule, execute, outputs); "
        "execute ms: Worker.execute (inputs, forward, sampling)",
        device,
        ops,
        "roofline: (weights + K/V read) / device ms, against a "
        f"{COPY_MIB} MiB tensor copy's bandwidth (read + write)",
    ]


def payload(
    rows: list[StepRow], settings: dict[str, Any], machine: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    return {
        "command": "kvray bench step",
        "settings": settings,
        "machine": machine,
        **extra,
        "rows": [r.to_dict() for r in rows],
    }
