"""What every backend of `kvray bench throughput` is handed: the command's resolved inputs,
plus the progress bar and the output-length check they share."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench.common.workload import Workload


@dataclass(frozen=True)
class Run:
    """What every backend needs: the resolved inputs of this command."""

    args: argparse.Namespace
    model_dir: Path
    device: str
    workload: Workload
    warmup: Workload


def progress_bar(total: int, desc: str, *, enabled: bool = True) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, disable=not enabled)


def length_notes(workload: Workload, generated: list[int]) -> list[str]:
    wrong = sum(g != req.output_len for g, req in zip(generated, workload.requests, strict=True))
    if not wrong:
        return []
    return [f"WARNING: {wrong} requests did not produce exactly their output length"]
