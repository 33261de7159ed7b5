"""Per-step timing of the engine on a GPU, eager against compiled (run by tests/gpu/check.sh).

For each decode batch size B: B prompts of 64 tokens; the time of generating 33 tokens minus
that of generating 1 is 32 decode steps, so decode ms/step = difference / 32. Then a prefill
of 16 prompts of 512 tokens (8,192 tokens, four 2,048-token steps). Modes in the order eager,
compiled, eager again (order effects show as a difference between the two eager columns).
Last, per mode, a torch.profiler table of 17 steps: the ops that cost the most host and
device time.

Usage: python tests/gpu/step_profile.py [--model random:qwen3-0.6b] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

BATCHES = (1, 8, 32, 128)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 3000) for _ in range(length)] for _ in range(n)]


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> float:  # noqa: ANN001
    from workers import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    _sync()
    return time.perf_counter() - t0


def _decode_ms(llm, b: int) -> float:  # noqa: ANN001
    """ms per decode step of b sequences: 33 tokens minus 1, best of two, fresh prompts."""
    one = min(_timed(llm, _prompts(b, 64, 10 * b + i), 1) for i in range(2))
    many = min(_timed(llm, _prompts(b, 64, 10 * b + 5 + i), 33) for i in range(2))
    return (many - one) / 32 * 1e3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def _engine(model_dir: Path, compile: bool) -> Iterator[Any]:
    """An offline engine on the model (fixed 8 GiB KV cache), warmed up, shut down after."""
    from workers import LLM

    llm = LLM(str(model_dir), dtype="bfloat16", compile=compile, kv_cache_memory_bytes=8 << 30)
    try:
        _timed(llm, _prompts(128, 64, 99), 8)  # warm-up: every decode size, one prefill size
        yield llm
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure(model_dir: Path, compile: bool) -> dict[str, float]:
    row: dict[str, float] = {}
    with _engine(model_dir, compile) as llm:
        # Fresh prompts for every run: a repeated one would hit the prefix cache.
        for b in BATCHES:
            row[f"decode B={b} ms/step"] = _decode_ms(llm, b)
        prefill = min(_timed(llm, _prompts(16, 512, 7 + i), 1) for i in range(2))
        row["prefill 8192 tok ms/step"] = prefill / 4 * 1e3
        compiled = llm.engine.executor.worker.forward.compiled
        if compiled is not None and compiled.graphs is not None:
            row["graph replays"] = compiled.graphs.replays
    return row


def profile_steps(model_dir: Path, compile: bool, out: Path | None) -> None:
    """torch.profiler over 17 steps of 32 sequences (one prefill, then 16 decode steps)."""
    from torch.profiler import ProfilerActivity, profile

    mode = "compiled" if compile else "eager"
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with _engine(model_dir, compile) as llm, profile(activities=activities) as prof:
        _timed(llm, _prompts(32, 64, 3), 17)
    keys = ["self_cpu_time_total"] + (["self_cuda_time_total"] if len(activities) > 1 else [])
    for key in keys:
        table = prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=48)
        print(f"\n-- {mode}: 17 steps of 32 sequences, by {key}\n{table}")
        if out is not None:
            (out / f"profile_{mode}.txt").open("a").write(table + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from cluster.bench.common.random_model import random_model_dir

    model_dir = (
        random_model_dir(args.model.split(":", 1)[1], dtype="bfloat16")
        if args.model.startswith("random:")
        else Path(args.model)
    )
    # Timings first, eager again after compiled: one process runs all three, so a drift with
    # the order (first-use costs) shows as eager != eager again. The profiler runs last.
    eager = measure(model_dir, False)
    compiled = measure(model_dir, True)
    again = measure(model_dir, False)
    for compile in (False, True):
        profile_steps(model_dir, compile, args.out)
    print(f"\n{'ms':<28}{'eager':>10}{'compiled':>10}{'eager 2nd':>10}{'speed-up':>10}")
    for key in eager:
        e, c, a = eager[key], compiled.get(key, float("nan")), again.get(key, float("nan"))
        print(f"{key:<28}{e:>10.2f}{c:>10.2f}{a:>10.2f}{min(e, a) / c:>9.2f}x")
    for key, c in compiled.items():
        if key not in eager:
            print(f"{key:<28}{'':>10}{c:>10.2f}")


if __name__ == "__main__":
    main()
