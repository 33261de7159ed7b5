"""The `--model` of the benchmarks that load a checkpoint: a directory, `random:NAME` (a
seeded random-weight checkpoint of a real shape, cluster/bench/common/random_model.py), or
nothing for the built-in demo model."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory (default: the built-in demo model), or random:qwen3-100m / "
        "random:qwen3-0.6b for a seeded random-weight checkpoint of that shape",
    )


def bench_model_dir(model: str | None) -> Path:
    """The checkpoint directory `--model` names; SystemExit with the reason when there is none."""
    if model and model.startswith("random:"):
        from cluster.bench.common.random_model import random_model_dir

        try:  # stored in bfloat16, as the real checkpoints of these shapes are
            return random_model_dir(model.split(":", 1)[1], dtype="bfloat16")
        except ValueError as err:
            raise SystemExit(f"--model {model}: {err}") from None
    if model:
        if not (Path(model) / "config.json").is_file():
            raise SystemExit(f"--model {model}: not a checkpoint directory (no config.json)")
        return Path(model)
    from workers.demo import demo_model_dir

    return demo_model_dir()
