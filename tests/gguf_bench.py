"""Not a test: decode tokens/s of a random model in bfloat16 against the same shape as a Q4_K
GGUF file held 4-bit (workers/gguf/int4.py), through `kvray bench step`'s decode measurement
(cluster/bench/step/main.py `measure`), engines one after the other, bfloat16 compute.

The GGUF file takes the random checkpoint's embeddings, norms and tokenizer (float32) and
random Q4_K blocks for every projection (tests/gguf_checkpoints.py `random_k_blocks`: gguf-py
cannot quantize K-quants; the speed does not depend on the values). Written once beside the
checkpoint (`<dir>-q4_k.gguf`).

    OMP_NUM_THREADS=1 python -m tests.gguf_bench --model random:qwen3-100m --batch-sizes 1,32
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import median
from typing import Any

from cluster.bench.common.model_arg import add_model_argument, bench_model_dir
from cluster.bench.step import main as step
from tests.gguf_checkpoints import hf_to_gguf


def q4_k_file(src: Path) -> Path:
    """`src` as a GGUF file whose projections are random Q4_K blocks (written once)."""
    out = src.with_name(src.name + "-q4_k.gguf")
    return out if out.is_file() else hf_to_gguf(src, out, random_projections="Q4_K")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.gguf_bench", description=__doc__)
    add_model_argument(p)
    p.add_argument("--batch-sizes", type=step._int_list, default=(1, 32))
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    base = bench_model_dir(args.model)
    gguf_path = q4_k_file(base)
    from workers.config import ModelConfig
    from workers.quantization import describe

    quant = ModelConfig.from_pretrained(gguf_path).quantization
    print(f"{gguf_path.name}: quantization {describe(quant)}")
    # `measure` reads a checkpoint directory's tokenizer for its prompts: the base one's.
    step.bench_model_dir = lambda m: Path(m)  # type: ignore[assignment]
    import cluster.bench.common.workload as workload

    ids = workload.sampleable_token_ids(base)
    workload.sampleable_token_ids = lambda _d: ids  # type: ignore[assignment]
    runs = {"bfloat16": (base, True), "Q4_K int4 (fast path)": (gguf_path, True)}
    runs["Q4_K int4 (reference)"] = (gguf_path, False)
    results: dict[str, Any] = {}
    for label, (model, kernels) in runs.items():
        settings = step.StepSettings(
            model=str(model),
            batch_sizes=tuple(args.batch_sizes),
            context=args.context,
            prefill_tokens=32,
            prefill_steps=1,
            steps=args.steps,
            warmup=args.warmup,
            dtype="bfloat16",
            device="cpu",
            cpu_kernels=kernels,
        )
        rows = [r for r in step.measure(settings)["rows"] if r.case == "decode"]
        results[label] = {r.batch: r.batch * 1000 / median(r.step_ms) for r in rows}
    first = next(iter(results.values()))
    print(f"\ndecode tokens/s, {base.name}, bfloat16 compute, context {args.context}")
    for label, per in results.items():
        cells = "".join(f"{per[b]:>9.1f} ({per[b] / first[b]:.2f}x)" for b in args.batch_sizes)
        print(f"{label:<24}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
