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

import numpy as np

from cluster.bench.common.model_arg import add_model_argument, bench_model_dir
from cluster.bench.step import main as step
from tests.gguf_checkpoints import _LAYER_TO_GGUF, _TO_GGUF, _add_tokenizer, random_k_blocks


def q4_k_file(src: Path) -> Path:
    """`src` (a Qwen3 / Qwen2 checkpoint: no Q/K permutation) as a GGUF file, projections Q4_K."""
    import json

    import gguf
    from safetensors.torch import load_file

    out = src.with_name(src.name + "-q4_k.gguf")
    if out.is_file():
        return out
    cfg = json.loads((src / "config.json").read_text())
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    writer = gguf.GGUFWriter(str(out), cfg["model_type"])
    _add_tokenizer(writer, src)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg.get("head_dim") or hidden // heads)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rng = np.random.default_rng(0)
    q4_k = gguf.GGMLQuantizationType.Q4_K
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            module, suffix = name.rsplit(".", 1)
            if module.startswith("model.layers."):
                part = module.split(".", 3)[-1]
                gguf_name = f"blk.{module.split('.')[2]}.{_LAYER_TO_GGUF[part]}.{suffix}"
            else:
                part, gguf_name = None, f"{_TO_GGUF[module]}.{suffix}"
            if part is not None and part.endswith("_proj") and suffix == "weight":
                writer.add_tensor(gguf_name, random_k_blocks("Q4_K", *t.shape, rng), raw_dtype=q4_k)
            else:
                writer.add_tensor(gguf_name, t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


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
